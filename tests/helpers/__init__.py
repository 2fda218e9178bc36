"""Helpers shared by a single-process test module in tests/unit and its MPI half in tests/mpi
(importable because pytest puts tests/, the folder of conftest.py, on sys.path)."""
