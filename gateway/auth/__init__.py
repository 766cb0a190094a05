"""Who is calling: the identity types every domain reads and the bearer-key route dependencies.

It imports no domain package: keys, tenants and audit all depend on it, and it reaches the key
store only through the :class:`~gateway.auth.identity.Authenticator` that the app wires in.
"""
