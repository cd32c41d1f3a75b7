"""`kvgate doctor`: read running engines (and the gateway) and explain what starves them."""
