"""The one module that imports prometheus_client: metric families built from the metric contract,
the /metrics handler, and the text-format parser. Everything else imports these from here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.aiohttp import make_aiohttp_handler
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from gputrace.metric_names import MetricSpec

__all__ = ["Collector", "CounterMetricFamily", "GaugeMetricFamily", "HistogramMetricFamily", "Metric",
           "Sample", "family",
           "metrics_handler", "parse_text"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def family(spec: MetricSpec, labels: Sequence[str] | None = None,
           value: float | None = None) -> GaugeMetricFamily | CounterMetricFamily:
    """An empty (or single-valued) family of the spec's type, name and help text."""
    cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
    return cls(spec.family, spec.help, value=value, labels=None if labels is None else list(labels))


def metrics_handler(*collectors: Collector, auto_describe: bool = False) -> Handler:
    """An aiohttp handler serving the collectors' families in the text exposition format."""
    registry = CollectorRegistry(auto_describe=auto_describe)
    for collector in collectors:
        registry.register(collector)
    handler: Handler = make_aiohttp_handler(registry)
    return handler


def parse_text(text: str) -> Iterable[Metric]:
    """The families of an exposition-format text; raises ValueError for text that is not one."""
    return text_string_to_metric_families(text)
