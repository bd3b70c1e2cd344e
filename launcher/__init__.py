"""How a person starts the engine: Hydra apps, Ray cluster connection, reports."""
import os
import sys


def runs_an_app() -> bool:
    """Whether this process is one of the launcher's apps, run as `python -m launcher.<app>` or by
    its file's path, not a program that imports one (pytest, a Ray worker, `python -c`)."""
    argv = sys.orig_argv
    if any(flag == "-m" and module.startswith("launcher.")
           for flag, module in zip(argv, argv[1:])):
        return True
    script = sys.argv[0] if sys.argv else ""
    package = os.path.dirname(os.path.realpath(__file__))
    return script.endswith(".py") and os.path.realpath(script).startswith(package + os.sep)


# The app's process starts itself again with Intel's OpenMP and tcmalloc preloaded, where they
# won on this machine, here, before the app's module is imported (it imports torch, which the
# process being replaced would then have loaded for nothing).
if runs_an_app():
    from engine.cpu_runtime import relaunch_preloaded

    relaunch_preloaded()
