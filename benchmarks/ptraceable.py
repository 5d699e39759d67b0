"""Runs a command that any process of this user may attach to with ptrace (py-spy --pid), then execs it:
   python3 benchmarks/ptraceable.py CMD [ARGS...]
Under Yama's ptrace_scope 1 only a process's ancestors may trace it; PR_SET_PTRACER_ANY lifts that for this
process, and the setting stays through exec. Python processes the command starts (a server's engine process)
do the same at start-up: ptraceable_site/ (a sitecustomize) goes first on their PYTHONPATH. Where Yama is
absent the call fails and nothing is needed."""
import ctypes
import os
import sys

PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1)

if len(sys.argv) < 2:
    sys.exit(__doc__)
ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)
site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ptraceable_site")
os.environ["PYTHONPATH"] = os.pathsep.join([site, *filter(None, [os.environ.get("PYTHONPATH")])])
os.execvp(sys.argv[1], sys.argv[1:])
