"""The agent's Prometheus exposition: a custom Collector that builds fresh families at scrape time.

Nothing is kept in global gauges: every scrape reads the newest sample per GPU, so a GPU that stops
reporting a metric simply loses that series (None is never exported as 0).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

from gputrace import metric_names as mn
from gputrace.agent.sampling import LoopStats, SampleRing
from gputrace.exposition import Collector, GaugeMetricFamily, Metric, Sample, family
from gputrace.gpu.sampler import ROW_INDEX, SampleRow
from gputrace.model import DeviceInfo
from gputrace.topology import Placement

_ENERGY, _LOST = ROW_INDEX["energy_j"], ROW_INDEX["lost"]


class GpuCollector(Collector):
    """Builds gputrace_* (and optionally DCGM_FI_*) families from the newest samples per GPU."""

    def __init__(self, stats: LoopStats, ring: SampleRing, devices: Sequence[DeviceInfo], host: str,
                 placements: Sequence[Placement] | None = None, dcgm_compat: bool = False,
                 dcgm_schema: str = "4.8") -> None:
        self.stats = stats
        self.ring = ring
        self.host = host
        self.dcgm_compat = dcgm_compat
        self.dcgm_gauges = mn.DCGM_SCHEMAS[dcgm_schema]  # the names and units of that dcgm-exporter
        rank_of = {p.gpu_index: p for p in placements or ()}
        self.label_names = [n for n in mn.GPU_LABELS if placements or n not in mn.RANK_LABELS]
        self._labels: dict[int, list[str]] = {}
        self._dcgm_labels: dict[int, list[str]] = {}
        self._label_dicts: dict[int, dict[str, str]] = {}
        self._dcgm_label_dicts: dict[int, dict[str, str]] = {}
        for d in devices:
            labels = [host, str(d.gpu_index), d.uuid or "", d.name or ""]
            if placements:
                placed = rank_of.get(d.gpu_index)
                labels += [str(placed.pp_rank), str(placed.tp_rank)] if placed else ["", ""]
            self._labels[d.gpu_index] = labels
            self._dcgm_labels[d.gpu_index] = [str(d.gpu_index), d.uuid or "", d.pci_bus_id or "",
                                              f"nvidia{d.gpu_index}", d.name or "", host]
            # built once and shared by every series of the GPU (the exposition only reads them)
            self._label_dicts[d.gpu_index] = dict(zip(self.label_names, labels, strict=True))
            self._dcgm_label_dicts[d.gpu_index] = dict(zip(mn.DCGM_LABELS, self._dcgm_labels[d.gpu_index],
                                                           strict=True))

    def describe(self) -> Iterable[Metric]:
        return []  # families depend on what the GPUs support: built at scrape time only

    def collect(self) -> Iterable[Metric]:
        started = time.perf_counter()
        latest, latest_util, latest_memory_util = self.ring.latest()
        # utilization fields come from the newest driver sample carrying them, the rest from ticks
        sources = {"utilization_ratio": latest_util, "memory_utilization_ratio": latest_memory_util}
        families: list[Metric] = []
        families += self._families(mn.GPU_GAUGES, self._label_dicts, latest, sources)
        energy = family(mn.GPU_ENERGY, self.label_names)
        lost = family(mn.GPU_LOST, self.label_names)
        busy = family(mn.GPU_BUSY, self.label_names)
        busy_s = self.ring.busy_seconds()
        for gpu, labels in self._labels.items():
            if gpu in busy_s:
                busy.add_metric(labels, busy_s[gpu])
            s = latest.get(gpu)
            if s is None:
                continue
            if s[_ENERGY] is not None:
                energy.add_metric(labels, s[_ENERGY])
            lost.add_metric(labels, 1.0 if s[_LOST] else 0.0)
        families += [energy, lost, busy]
        if self.dcgm_compat:
            families += self._families(self.dcgm_gauges, self._dcgm_label_dicts, latest, sources)
        st = self.stats
        families += [family(mn.AGENT_UP, value=1.0),
                     family(mn.AGENT_SAMPLES, value=float(st.samples)),
                     family(mn.AGENT_SAMPLING_ERRORS, value=float(st.errors)),
                     family(mn.AGENT_RING_SAMPLES, value=float(len(self.ring))),
                     family(mn.AGENT_SAMPLE_DURATION, value=st.last_sample_cost_s),
                     family(mn.AGENT_SCRAPE_DURATION, value=time.perf_counter() - started)]
        return families

    @staticmethod
    def _families(specs: Sequence[mn.MetricSpec], labels_by_gpu: Mapping[int, dict[str, str]],
                  latest: Mapping[int, SampleRow],
                  sources: Mapping[str, Mapping[int, SampleRow]]) -> list[Metric]:
        out: list[Metric] = []
        for spec in specs:
            assert spec.field is not None, spec.name  # the GPU gauges each carry a sample field
            name, scale = spec.name, spec.scale
            fam = GaugeMetricFamily(name, spec.help)
            samples = fam.samples
            source = sources.get(spec.field, latest)
            index = ROW_INDEX[spec.field]
            for gpu, labels in labels_by_gpu.items():
                s = source.get(gpu)
                value = s[index] if s is not None else None
                if value is not None:
                    samples.append(Sample(name, labels, value * scale))
            if samples:
                out.append(fam)
        return out
