"""`kvgate plan` and `kvgate doctor`: deployment sizing arithmetic, pure and shown."""
