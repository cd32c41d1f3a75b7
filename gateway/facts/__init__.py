"""What each engine says about itself (gateway.facts.read), read at start and again when a
replica comes back into service (gateway.facts.service)."""
