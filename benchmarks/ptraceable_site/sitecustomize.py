"""Imported at the start of every Python process started under benchmarks/ptraceable.py (its directory is on
their PYTHONPATH): the process lets any process of this user attach with ptrace, as ptraceable.py does for
the command itself (so py-spy can attach to a server's engine process too)."""
import ctypes

ctypes.CDLL(None, use_errno=True).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER, ANY
