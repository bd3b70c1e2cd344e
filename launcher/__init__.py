"""How a person starts the engine: Hydra apps, Ray cluster connection, reports."""
import sys

# Run as `python -m launcher.<app>`: the process starts itself again with Intel's OpenMP and
# tcmalloc preloaded, where they won on this machine, here, before the app's module is imported
# (it imports torch, which the process being replaced would then have loaded for nothing).
if any(flag == "-m" and module.startswith("launcher.")
       for flag, module in zip(sys.orig_argv, sys.orig_argv[1:])):
    from engine.cpu_runtime import relaunch_preloaded

    relaunch_preloaded()
