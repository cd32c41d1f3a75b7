"""API keys, tenants and their quotas: who may call the gateway, for what, how much.

Off unless a key is configured (`auth:` in the settings, a keys file, or keys in the
shared Redis store); then every route but `/health` and `/ready` needs a key. See
docs/auth.md.
"""
