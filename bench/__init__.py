"""hpcdl's benchmarks, importable as hpcdl.bench (hpcdl/bench is a link to this
directory; an installed hpcdl carries a copy), so `hpcdl bench NAME` runs the
same code as `python bench/NAME.py`."""
