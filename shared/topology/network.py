"""Peers, regions and the links between them.

A :class:`Network` knows the latency and bandwidth between any two peers: a measured
per-pair value when one was reported (servers measure the RTT to the peers they talk
to), else the link between their regions from the shipped matrix, else the intra-region
default (2 Gbit/s, 5 ms, as in DT-FM's emulation). The cost model and the planner work
on dense matrices (:meth:`Network.matrices`) so that one placement costs a few numpy
operations, not thousands of dictionary look-ups.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources

import numpy as np

DATA_PACKAGE = "shared.topology"
WORLD_LINKS_CSV = "data/region_links.csv"
REGIONAL_LINKS_CSV = "data/regional_links.csv"


@dataclass(frozen=True)
class Link:
    """A symmetric link: round-trip latency in ms and bandwidth in Gbit/s."""

    rtt_ms: float
    bandwidth_gbps: float

    def __post_init__(self) -> None:
        if not (self.rtt_ms >= 0 and self.bandwidth_gbps > 0):
            raise ValueError(f"a link needs rtt_ms >= 0 and bandwidth_gbps > 0, got {self}")


INTRA_REGION = Link(rtt_ms=5.0, bandwidth_gbps=2.0)


@dataclass(frozen=True)
class Peer:
    """A stage server candidate: where it is and how fast it computes.

    ``throughput`` is samples per second through one stage's forward and backward (any
    unit works as long as all peers and the workload's batch use the same one).
    """

    peer_id: str
    region: str
    throughput: float = 1.0

    def __post_init__(self) -> None:
        if not self.throughput > 0:
            raise ValueError(f"peer {self.peer_id!r}: throughput must be > 0, got {self.throughput}")


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


def parse_links(text: str) -> dict[tuple[str, str], Link]:
    """Rows ``region_a,region_b,rtt_ms,bandwidth_gbps`` into links keyed by sorted pair."""
    links: dict[tuple[str, str], Link] = {}
    for row in csv.DictReader(io.StringIO(text)):
        a, b = row["region_a"].strip(), row["region_b"].strip()
        if a == b:
            raise ValueError(f"region link {a}-{b} links a region to itself; intra-region links are INTRA_REGION")
        links[_pair(a, b)] = Link(float(row["rtt_ms"]), float(row["bandwidth_gbps"]))
    return links


def load_links(name: str = WORLD_LINKS_CSV) -> dict[tuple[str, str], Link]:
    """A links file shipped in ``shared/topology/data``."""
    return parse_links(resources.files(DATA_PACKAGE).joinpath(name).read_text(encoding="utf-8"))


@dataclass(frozen=True)
class Network:
    """Region-to-region links, the intra-region link, and per-peer-pair measurements."""

    region_links: Mapping[tuple[str, str], Link]
    intra: Link = INTRA_REGION
    measured: Mapping[tuple[str, str], Link] = field(default_factory=dict)  # keyed by sorted peer-id pair
    # the link between two different regions that ``region_links`` does not know (e.g. a
    # server that did not say where it is); None: such a pair is an error
    fallback: Link | None = None

    @property
    def regions(self) -> list[str]:
        return sorted({r for pair in self.region_links for r in pair})

    def region_link(self, a: str, b: str) -> Link:
        if a == b:
            return self.intra
        try:
            return self.region_links[_pair(a, b)]
        except KeyError:
            if self.fallback is not None:
                return self.fallback
            raise KeyError(f"no link between regions {a!r} and {b!r}; known regions: {self.regions}") from None

    def link(self, a: Peer, b: Peer) -> Link:
        """The measured link between the two peers if any, else their regions' link."""
        return self.measured.get(_pair(a.peer_id, b.peer_id)) or self.region_link(a.region, b.region)

    def with_region_links(self, links: Mapping[tuple[str, str], Link]) -> Network:
        """This network with ``links`` added or replacing region pairs."""
        merged = dict(self.region_links)
        merged.update({_pair(*k): v for k, v in links.items()})
        return Network(merged, self.intra, self.measured, self.fallback)

    def with_measurements(self, links: Mapping[tuple[str, str], Link]) -> Network:
        """This network with per-peer-pair measurements (peer ids) added or replaced."""
        merged = dict(self.measured)
        merged.update({_pair(*k): v for k, v in links.items()})
        return Network(self.region_links, self.intra, merged, self.fallback)

    def with_fallback(self, link: Link | None) -> Network:
        """This network with ``link`` between regions it has no link for."""
        return Network(self.region_links, self.intra, self.measured, link)

    def matrices(self, peers: Sequence[Peer]) -> tuple[np.ndarray, np.ndarray]:
        """``(rtt_s, bandwidth_gbps)``, both ``(n, n)`` float arrays over ``peers``.

        Built from a region x region table indexed by each peer's region, then patched
        with the measured pairs, so 1,000 peers cost one fancy-index, not a million
        look-ups. The diagonal holds the intra-region link (the cost never uses it).
        """
        names = sorted({p.region for p in peers})
        index = {r: i for i, r in enumerate(names)}
        rtt_r = np.empty((len(names), len(names)))
        bw_r = np.empty_like(rtt_r)
        for a in names:
            for b in names:
                link = self.region_link(a, b)
                rtt_r[index[a], index[b]] = link.rtt_ms / 1e3
                bw_r[index[a], index[b]] = link.bandwidth_gbps
        region_of = np.array([index[p.region] for p in peers], dtype=np.intp)
        rtt = rtt_r[np.ix_(region_of, region_of)]
        bw = bw_r[np.ix_(region_of, region_of)]
        if self.measured:
            position = {p.peer_id: i for i, p in enumerate(peers)}
            for (a, b), link in self.measured.items():
                if a in position and b in position:
                    i, j = position[a], position[b]
                    rtt[i, j] = rtt[j, i] = link.rtt_ms / 1e3
                    bw[i, j] = bw[j, i] = link.bandwidth_gbps
        return rtt, bw

    def peer_classes(self, peers: Sequence[Peer]) -> list[int]:
        """Equal ids for peers that are interchangeable: same region and throughput and no
        measured link of their own. A placement's cost depends only on how many peers of
        each class each stage holds, which the planner exploits (caching, no-op swaps)."""
        measured_ids = {pid for pair in self.measured for pid in pair}
        keys: dict[tuple, int] = {}
        classes = []
        for p in peers:
            key = ("peer", p.peer_id) if p.peer_id in measured_ids else ("region", p.region, p.throughput)
            classes.append(keys.setdefault(key, len(keys)))
        return classes


def world_network() -> Network:
    """The shipped 10-region matrix (see ``data/README.md``)."""
    return Network(load_links(WORLD_LINKS_CSV))


def regional_network() -> Network:
    """The world matrix with DT-FM's regional scenario links (California) laid over it."""
    return world_network().with_region_links(load_links(REGIONAL_LINKS_CSV))


def peers_in_regions(counts: Mapping[str, int] | Iterable[tuple[str, int]], throughput: float = 1.0) -> list[Peer]:
    """``counts[region]`` peers in each region, ids ``region-i``, in the given order."""
    items = counts.items() if isinstance(counts, Mapping) else counts
    return [Peer(f"{region}-{i}", region, throughput) for region, n in items for i in range(n)]
