"""Replica discovery from DNS (SRV or A/AAAA records), re-resolved on an interval.

`gateway.discovery.install` wires a `DnsDiscovery` service into the app when the
`discovery:` section names at least one DNS target.
"""
