"""The benchmarks, one script each (`python bench/NAME.py`): a package, so each has one import name
(`bench.timing`) and mypy checks them with the rest."""
