"""The user's own package, named ``src`` on purpose: dsdebug's import name must not clash with it."""
