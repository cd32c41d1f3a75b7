"""placeholder"""
from typing import Any
def register(subparsers: Any) -> None:
    return None
