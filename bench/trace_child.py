"""`python -m trace_child`: a `--frontends` worker or engine with bench/trace_step.py's stamps.

bench/trace_step.py's traced router starts its children through this module instead of
`python -m gdn_server.frontend|engine` (GDN_TRACE_MODULE says which, GDN_TRACE_ROLE which stamps,
GDN_TRACE_DIR where they go). It wraps the child's methods, then runs the module's own main();
the stamps are written when the child exits (on the router's SIGTERM, it drains and returns).
GDN_TRACE_HOOK (`module:function`, default `trace_step:stamp_child`) names what wraps them:
bench/launch_pairs.py logs an engine's launches through the same door.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    role = os.environ["GDN_TRACE_ROLE"]
    # this folder's modules: the router put it on PYTHONPATH
    hook_module, hook = os.environ.get("GDN_TRACE_HOOK", "trace_step:stamp_child").split(":")
    getattr(importlib.import_module(hook_module), hook)(role, Path(os.environ["GDN_TRACE_DIR"]) / f"{role}_{os.getpid()}.json")
    # the module itself, not a copy run as __main__: the stamps wrap its classes and functions
    sys.exit(importlib.import_module(os.environ["GDN_TRACE_MODULE"]).main())
