"""Samplers of a data-parallel run: each process's part of the one-process batches.

Training (:class:`ShardedBatchSampler`): the one-process order of an epoch (the seeded
:class:`engine.data.manager.EpochSampler`, the same on every process) is cut into the global
batches of ``DATALOADER.TRAIN_X.BATCH_SIZE`` exactly as one process cuts it, and every global
batch into ``world`` contiguous shards as even as possible (8 items, 3 processes: 3, 3, 2), in
rank order. The shards of one step, concatenated in rank order, are the one-process batch, so
an N-process run sees the same global batches in the same order as a 1-process run with the
same seed (and a run resumes with another N). The per-sample augmentation seeds travel with
the items, so an item is augmented as in one process.

Evaluation (:class:`ShardedEvalSampler`): the evaluation set is cut into ``world`` contiguous
shards (no padding, no duplicates), each batched by ``DATALOADER.TEST.BATCH_SIZE``; the
outputs are gathered in rank order, which is the set's order (:mod:`engine.distributed`).
"""

from __future__ import annotations

from torch.utils.data import Sampler

from engine.errors import ConfigError


def split_sizes(n: int, world: int) -> list[int]:
    """``n`` items over ``world`` processes, as even as possible, the larger shards first."""
    return [n // world + (1 if r < n % world else 0) for r in range(world)]


def shard_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s contiguous shard of ``n`` items."""
    sizes = split_sizes(n, world)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def batch_sizes(num_items: int, batch_size: int, drop_last: bool) -> list[int]:
    """The sizes of the global batches of an epoch (as one process's DataLoader cuts them)."""
    full, rest = divmod(num_items, batch_size)
    return [batch_size] * full + ([rest] if rest and not drop_last else [])


def check_shards(num_items: int, batch_size: int, drop_last: bool, world: int) -> None:
    """Refuse a batch some process would get no item of (one clear message with the fixes)."""
    sizes = batch_sizes(num_items, batch_size, drop_last)
    small = [s for s in sizes if s < world]
    if not small:
        return
    which = "batch" if small[0] == batch_size else "last batch of an epoch"
    raise ConfigError(
        f"A data-parallel run over {world} processes splits every global batch over them, but "
        f"the {which} holds {small[0]} item(s) ({num_items} training items, "
        f"DATALOADER.TRAIN_X.BATCH_SIZE {batch_size}): a process would get none. Use at most "
        f"{small[0]} processes, a batch size whose last batch has at least {world} items, or "
        "DATALOADER.TRAIN_X.DROP_LAST True"
    )


class ShardedBatchSampler(Sampler):
    """This process's shard of every global batch of the one-process order (module docstring).

    Args:
        sampler: the one-process :class:`~engine.data.manager.EpochSampler` (``set_epoch``
            and ``num_items`` are its).
        batch_size: the global batch size.
        drop_last: drop the last partial global batch (as the one-process loader).
        rank, world: this process and the number of processes.
    """

    def __init__(self, sampler, batch_size: int, drop_last: bool, rank: int, world: int):
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.rank, self.world = rank, world
        check_shards(sampler.num_items, batch_size, drop_last, world)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(batch_sizes(self.sampler.num_items, self.batch_size, self.drop_last))

    def full_shard(self) -> int:
        """This process's items of a full global batch."""
        return split_sizes(self.batch_size, self.world)[self.rank]

    def __iter__(self):
        check_shards(self.sampler.num_items, self.batch_size, self.drop_last, self.world)
        keys = list(self.sampler)
        start = 0
        for size in batch_sizes(len(keys), self.batch_size, self.drop_last):
            lo, hi = shard_bounds(size, self.world, self.rank)
            yield keys[start + lo : start + hi]
            start += size


class ShardedEvalSampler(Sampler):
    """Batches of this process's contiguous shard of an evaluation set (module docstring)."""

    def __init__(self, num_items: int, batch_size: int, rank: int, world: int):
        if num_items < world:
            raise ConfigError(
                f"The evaluation set has {num_items} image(s), fewer than the {world} processes "
                "of this data-parallel run: evaluate with fewer processes"
            )
        self.num_items = num_items
        self.batch_size = batch_size
        self.rank, self.world = rank, world

    def bounds(self) -> tuple[int, int]:
        return shard_bounds(self.num_items, self.world, self.rank)

    def __len__(self) -> int:
        lo, hi = self.bounds()
        return -(-(hi - lo) // self.batch_size)

    def __iter__(self):
        lo, hi = self.bounds()
        for start in range(lo, hi, self.batch_size):
            yield list(range(start, min(start + self.batch_size, hi)))


def sharded_batches(sampler, batch_size: int, drop_last: bool, is_train: bool):
    """The batch sampler of this process in a data-parallel run (training: the shards of the
    global batches; evaluation: its part of the set), or None in a one-process run."""
    from engine.distributed import data_parallel

    dp = data_parallel()
    if dp is None:
        return None
    rank, world = dp
    if is_train:
        return ShardedBatchSampler(sampler, batch_size, drop_last, rank, world)
    return ShardedEvalSampler(sampler.num_items, batch_size, rank, world)
