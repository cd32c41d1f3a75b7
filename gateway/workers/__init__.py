"""`kvgate serve --workers N`: one consistent `/metrics` over all worker processes."""
