"""The variable runtime: Variable, Module, scopes, initializers, random numbers, casting."""
