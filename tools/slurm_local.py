"""A real single-node SLURM cluster on this machine, for the grid's tests and for trying
``tools/grid.py --slurm`` without a cluster (root, Debian or Ubuntu).

It installs Debian's ``slurm-wlm``, ``munge``, ``slurmdbd`` and ``mariadb-server`` with apt-get
when they are missing, writes a localhost configuration into one folder (nothing under
``/etc/slurm`` or ``/etc/munge`` is read or written), starts ``munged``, ``mariadbd`` (bound to
127.0.0.1), ``slurmdbd`` (accounting: ``sacct`` knows how every job ended), ``slurmctld`` and
``slurmd``, and waits until ``sinfo`` shows the node idle. Every daemon listens on a free port
of 127.0.0.1 and is stopped by its process id (``stop``). The node has the machine's CPUs and
memory, and one stand-in GPU (``gres gpu:1`` on ``/dev/null``) for jobs that ask for one.
Short ``KillWait``, credential lifetime and scheduler intervals make a requeued job start again
within seconds instead of minutes. Commands (``sbatch``, ``squeue``, ``sacct``, ``scontrol``)
reach this cluster through ``SLURM_CONF=<folder>/slurm.conf``::

    python tools/slurm_local.py install                   # apt-get, when something is missing
    python tools/slurm_local.py start --dir /tmp/slurm    # prints: export SLURM_CONF=...
    export SLURM_CONF=/tmp/slurm/slurm.conf
    sinfo
    python tools/slurm_local.py stop --dir /tmp/slurm
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import os.path as osp
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time

PACKAGES = ("slurm-wlm", "munge", "slurmdbd", "mariadb-server")
# the programs each package brings (checked to decide whether to install)
PROGRAMS = (
    "slurmctld",
    "slurmd",
    "sbatch",
    "sacct",
    "munged",
    "mungekey",
    "munge",
    "slurmdbd",
    "mariadbd",
    "mariadb-install-db",
    "mariadb",
)
SBIN_PATH = "/usr/local/sbin:/usr/sbin:/sbin"
# Short timings: a requeued job starts again once its credential expired (cred_expire), the
# scheduler looks at pending jobs every 2 s and a killed job's processes get 5 s to end.
KILL_WAIT_S = 5
CRED_EXPIRE_S = 10
SCHEDULER_PARAMETERS = "bf_interval=2,sched_interval=2"
CLUSTER_NAME = "local"
PARTITION = "debug"
MUNGE_KEY, MUNGE_RUN = "/etc/munge/munge.key", "/run/munge"  # Debian's munge key and socket
DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd")  # in start order


class ClusterError(RuntimeError):
    """The local cluster cannot be installed or started (the message says why and what to do)."""


def which(program: str) -> str | None:
    return shutil.which(program, path=f"{os.environ.get('PATH', '')}:{SBIN_PATH}")


def missing_programs() -> list[str]:
    return [p for p in PROGRAMS if which(p) is None]


def unavailable_reason() -> str | None:
    """Why this machine cannot run the local cluster (None: it can, installing if needed)."""
    if os.geteuid() != 0:
        return "the local SLURM cluster needs root (it installs packages and runs daemons)"
    if missing_programs() and which("apt-get") is None:
        return (
            f"SLURM is not installed ({', '.join(missing_programs())} missing) and there is no "
            f"apt-get to install {' '.join(PACKAGES)}"
        )
    return None


def install(log=print) -> float:
    """Install the packages with apt-get when a program is missing; returns the seconds spent."""
    if not missing_programs():
        return 0.0
    t0 = time.time()
    log(f"Installing {' '.join(PACKAGES)} with apt-get ...")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    steps = (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
    )
    for cmd in steps:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            output = (proc.stdout + proc.stderr)[-2000:]
            raise ClusterError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output}")
    if missing_programs():
        raise ClusterError(f"Installed {' '.join(PACKAGES)} but {missing_programs()} are missing")
    return time.time() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024 - 512  # leave some for the daemons
    raise ClusterError("/proc/meminfo has no MemTotal")


class LocalCluster:
    """The daemons of a one-node cluster whose files live in ``root``.

    :meth:`start` writes the configuration and starts the daemons (their pids in
    ``<root>/pids.json``); :meth:`stop` ends them by pid, also from another process.
    """

    def __init__(self, root: str):
        self.root = osp.abspath(root)
        self.conf = osp.join(self.root, "slurm.conf")
        self.host = socket.gethostname().split(".")[0]
        self.pids: dict[str, int] = {}

    # -- paths and environment -------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return osp.join(self.root, *parts)

    @property
    def env(self) -> dict:
        """The environment of the daemons and of client commands: SLURM_CONF set."""
        return dict(os.environ, SLURM_CONF=self.conf, PATH=f"{os.environ['PATH']}:{SBIN_PATH}")

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> str:
        """A client command against this cluster; its output."""
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(f"{' '.join(cmd)} failed: {(proc.stdout + proc.stderr).strip()}")
        return proc.stdout

    # -- configuration ----------------------------------------------------------------------
    def write_config(self) -> None:
        ports = {k: free_port() for k in ("ctld", "slurmd", "dbd", "mysql")}
        self.ports = ports
        for sub in ("state", "spool", "log", "run", "mysql"):
            os.makedirs(self.path(sub), exist_ok=True)
        auth = "AuthType=auth/munge"
        cpus = os.cpu_count() or 1
        slurm_conf = f"""# a one-node cluster written by tools/slurm_local.py
ClusterName={CLUSTER_NAME}
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={ports["ctld"]}
SlurmdPort={ports["slurmd"]}
SlurmUser=root
SlurmdUser=root
{auth}
AuthInfo=cred_expire={CRED_EXPIRE_S}
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={ports["dbd"]}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MailProg=/bin/true
KillWait={KILL_WAIT_S}
SchedulerParameters={SCHEDULER_PARAMETERS}
StateSaveLocation={self.path("state")}
SlurmdSpoolDir={self.path("spool")}
SlurmctldPidFile={self.path("run", "slurmctld.pid")}
SlurmdPidFile={self.path("run", "slurmd.pid")}
SlurmctldLogFile={self.path("log", "slurmctld.log")}
SlurmdLogFile={self.path("log", "slurmd.log")}
GresTypes=gpu
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb()} Gres=gpu:1 \
State=UNKNOWN
PartitionName={PARTITION} Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
"""
        with open(self.conf, "w") as f:
            f.write(slurm_conf)
        with open(self.path("gres.conf"), "w") as f:  # a stand-in GPU (Count without File fails)
            f.write(f"NodeName={self.host} Name=gpu File=/dev/null\n")
        self.db_password = secrets.token_hex(12)
        dbd_conf = f"""{auth}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={ports["dbd"]}
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={ports["mysql"]}
StorageUser=slurm
StoragePass={self.db_password}
StorageLoc=slurm_acct_db
PidFile={self.path("run", "slurmdbd.pid")}
LogFile={self.path("log", "slurmdbd.log")}
"""
        path = self.path("slurmdbd.conf")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(dbd_conf)

    # -- daemons ----------------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str], **kw) -> None:
        log = open(self.path("log", f"{name}.out"), "ab")  # noqa: SIM115 (the daemon keeps it)
        proc = subprocess.Popen(
            cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **kw
        )
        log.close()
        self.pids[name] = proc.pid
        with open(self.path("pids.json"), "w") as f:
            json.dump(self.pids, f)

    def _wait(self, what: str, ready, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for name, pid in self.pids.items():
                if not _alive(pid):
                    raise ClusterError(
                        f"{name} stopped while waiting for {what}: {self.tail(name)}"
                    )
            with contextlib.suppress(Exception):
                if ready():
                    return
            time.sleep(0.2)
        raise ClusterError(f"Timed out after {timeout:.0f} s waiting for {what}")

    def tail(self, name: str, lines: int = 15) -> str:
        """The end of a daemon's logs (for error messages)."""
        text = []
        for log in (f"{name}.out", f"{name}.log"):
            with contextlib.suppress(OSError), open(self.path("log", log), errors="replace") as f:
                text += f.read().splitlines()[-lines:]
        return "\n".join(text) or "(no log)"

    def start_munge(self) -> None:
        """Start munged on its standard socket (SLURM's munge plugins use that one), unless a
        munged already answers there (then it is used and left running)."""
        if _succeeds([which("munge"), "-n"]):
            return
        if not osp.isfile(MUNGE_KEY):
            subprocess.run([which("mungekey"), "--create"], check=True, user="munge")
        os.makedirs(MUNGE_RUN, exist_ok=True)
        shutil.chown(MUNGE_RUN, "munge", "munge")
        os.chmod(MUNGE_RUN, 0o755)
        self._spawn("munged", [which("munged"), "--foreground"], user="munge", group="munge")
        self._wait("munged", lambda: _succeeds([which("munge"), "-n"]))

    def start_mariadb(self) -> None:
        datadir, sock = self.path("mysql", "data"), self.path("mysql", "mysql.sock")
        init = [which("mariadb-install-db"), "--no-defaults", "--user=root", f"--datadir={datadir}"]
        init += ["--skip-test-db", "--auth-root-authentication-method=socket"]
        proc = subprocess.run(init, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ClusterError(f"mariadb-install-db failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
        cmd = [which("mariadbd"), "--no-defaults", "--user=root", f"--datadir={datadir}"]
        cmd += [f"--socket={sock}", f"--port={self.ports['mysql']}", "--bind-address=127.0.0.1"]
        cmd += [f"--pid-file={self.path('run', 'mariadbd.pid')}", "--skip-log-bin"]
        cmd += ["--innodb-buffer-pool-size=32M", "--skip-name-resolve"]
        self._spawn("mariadbd", cmd)
        client = [which("mariadb"), "--no-defaults", f"--socket={sock}", "-uroot"]
        self._wait("mariadbd", lambda: _succeeds([*client, "-e", "SELECT 1"]))
        sql = (
            "CREATE DATABASE IF NOT EXISTS slurm_acct_db;"
            f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{self.db_password}';"
            "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
        )
        subprocess.run([*client, "-e", sql], check=True, capture_output=True)

    def start(self, log=print) -> float:
        """Write the configuration, start the daemons, wait for an idle node; the seconds spent.

        On failure every daemon started so far is stopped and the error names the daemon and
        the end of its log.
        """
        t0 = time.time()
        os.makedirs(self.root, exist_ok=True)
        atexit.register(self.stop)
        try:
            self.write_config()
            self.start_munge()
            self.start_mariadb()
            self._spawn("slurmdbd", [which("slurmdbd"), "-D"])
            self._wait("slurmdbd", lambda: _listening(self.ports["dbd"]))
            self._spawn("slurmctld", [which("slurmctld"), "-D", "-i"])
            self._wait("slurmctld", lambda: "UP" in self.run("scontrol", "ping", check=False))
            self._spawn("slurmd", [which("slurmd"), "-D", "-N", self.host])
            self._wait(
                "an idle node", lambda: self.run("sinfo", "-h", "-o", "%T").strip() == "idle"
            )
        except BaseException:
            self.stop()
            raise
        took = time.time() - t0
        log(f"SLURM cluster up in {took:.1f} s: export SLURM_CONF={self.conf}")
        return took

    def stop(self) -> None:
        """Cancel the jobs, then stop every daemon by its pid (SIGTERM, then SIGKILL)."""
        pids = self.pids or _read_pids(self.path("pids.json"))
        if not pids:
            return
        if _alive(pids.get("slurmctld", 0)):
            with contextlib.suppress(Exception):
                self.run("scancel", "--full", "--user", "root", check=False, timeout=10)
                deadline = time.time() + KILL_WAIT_S + 10
                while time.time() < deadline and self.run("squeue", "-h", timeout=10).strip():
                    time.sleep(0.5)
        for name in reversed(DAEMONS):
            pid = pids.get(name)
            if pid and _alive(pid):
                _terminate(pid)
        self.pids = {}
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path("pids.json"))


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:  # a child of ours that exited: reap it
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][:1] != "Z"
    return True


def _terminate(pid: int, timeout: float = 15) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.time() + timeout
    while time.time() < deadline and _alive(pid):
        time.sleep(0.1)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _succeeds(cmd: list[str]) -> bool:
    return subprocess.run(cmd, capture_output=True).returncode == 0


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _read_pids(path: str) -> dict:
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        return json.load(f)
    return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("action", choices=("install", "start", "stop"))
    parser.add_argument("--dir", help="folder of the configuration, logs, state (start, stop)")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if args.action == "install":
        if reason:
            print(f"Error: {reason}", file=sys.stderr)
            return 2
        took = install()
        print(f"Installed in {took:.1f} s" if took else f"{' '.join(PACKAGES)}: installed")
        return 0
    if not args.dir:
        parser.error(f"{args.action} needs --dir")
    cluster = LocalCluster(args.dir)
    if args.action == "stop":
        cluster.stop()
        print(f"Stopped the cluster of {cluster.root}")
        return 0
    if reason:
        print(f"Error: {reason}", file=sys.stderr)
        return 2
    if _read_pids(cluster.path("pids.json")):
        print(f"Error: {cluster.root} has a running cluster: stop it first", file=sys.stderr)
        return 2
    try:
        took = install()
        if took:
            print(f"Installed in {took:.1f} s")
        cluster.start()
    except ClusterError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    atexit.unregister(cluster.stop)  # the daemons outlive this command
    print(f"export SLURM_CONF={cluster.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
