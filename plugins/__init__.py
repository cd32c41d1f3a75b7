"""Built-in routing policies, loaded through the same registry as third-party ones.

See `gateway.policy.BUILTIN_POLICIES` for the name -> import-string table.
"""
