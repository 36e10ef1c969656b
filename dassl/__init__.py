"""A compatibility layer with Dassl.pytorch's import paths, backed by this project's engine.

Trainer files and tools written against Dassl (CoOp, CoCoOp, KgCoOp, ProGrad, MaPLe, ...) import
``dassl.engine``, ``dassl.utils``, ``dassl.optim``, ``dassl.metrics``, ``dassl.config``,
``dassl.data`` and ``dassl.evaluation``; these modules give them the names and signatures they
use (docs/porting-trainers.md lists them). Importing ``dassl`` itself loads nothing else, so a
script that only needs ``dassl.utils`` (CoOp's ``parse_test_res.py``) starts quickly.
"""
