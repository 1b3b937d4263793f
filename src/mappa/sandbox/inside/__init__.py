"""The steps of the runner (runner.py, beside this package): standard library only, relative imports only.

The runner is started as a script, and this package is bound beside it in the allowlisted root, so it is
imported there as the top-level `inside`; mappa imports it as `mappa.sandbox.inside` (for the runner's exit
status and tag). The snippet's own code sees none of it: the child removes it from `sys.modules`.
"""
