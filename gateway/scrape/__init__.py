"""Background scraping of engine `/metrics` into immutable `EngineLoad` snapshots."""

from gateway.scrape.adapters import CounterState, EngineReading, read_engine
from gateway.scrape.config import EngineKind, ScrapeSettings
from gateway.scrape.scraper import MetricsScraper, ScrapeHealthSink, ScrapeTarget

__all__ = [
    "CounterState",
    "EngineKind",
    "EngineReading",
    "MetricsScraper",
    "ScrapeHealthSink",
    "ScrapeSettings",
    "ScrapeTarget",
    "read_engine",
]
