"""The Cluster document: servers of devices, intra/inter-server links, device memory; paper Table 3 presets."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable

import networkx as nx

from . import documents
from .checks import is_finite, is_int, is_real, number, positive_int

VERSION = 1

GBPS = 1e9 / 8  # bytes per second in one Gbit/s
LINK_SHARING = ("held", "shared")  # a transfer holds its links whole, or shares them with concurrent ones


@dataclass
class Cluster:
    """``servers`` x ``devices_per_server`` devices; device id d is on server d // devices_per_server.

    Bandwidths in bytes/s, latencies in seconds, memory in bytes. Device id == torchrun global rank.
    """

    servers: int
    devices_per_server: int
    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float = 5e-6
    inter_latency: float = 30e-6
    device_memory: float = 16e9
    name: str = ""
    meta: dict = field(default_factory=dict)  # how the numbers were obtained (measured, preset, ...)
    # Measured ring-AllReduce numbers (bus bandwidth B/s, latency s per ring step), when they differ from the
    # links' (gloo reduces on the CPU, NCCL has its own algorithms); None: use the link numbers.
    intra_allreduce_bandwidth: float | None = None
    intra_allreduce_latency: float | None = None
    inter_allreduce_bandwidth: float | None = None
    inter_allreduce_latency: float | None = None
    # Measured ring-AllReduce numbers by group size inside one server: {r: [latency per ring step s, bus B/s]}.
    # A collective's cost per byte can depend on how many ranks take part (gloo on a shared CPU: 4 ranks on 2
    # cores reduce at half the bus bandwidth of 2); sizes between measured ones are interpolated.
    intra_allreduce_by_size: dict | None = None
    # How concurrent transfers use a link: "held" (one at a time, each at full bandwidth, in order of
    # readiness) or "shared" (all at once, max-min fair shares). The cost model and the simulator both follow it.
    link_sharing: str = "held"

    def __post_init__(self) -> None:
        for key in ("servers", "devices_per_server"):
            positive_int(f"Cluster.{key}", getattr(self, key))
        for key in ("intra_bandwidth", "inter_bandwidth", "device_memory"):  # inf memory overflowed D (V-C)
            number(f"Cluster.{key}", getattr(self, key), positive=True, finite=True)
        for key in ("intra_latency", "inter_latency"):
            v = getattr(self, key)
            if not is_finite(v):  # an inf latency made the model's estimate 0 ms
                raise ValueError(f"Cluster.{key}: expected a finite number of seconds >= 0, got {v!r}")
        for key in ("intra_allreduce_bandwidth", "inter_allreduce_bandwidth", "intra_allreduce_latency",
                    "inter_allreduce_latency"):
            v = getattr(self, key)
            if v is not None and (not is_finite(v) or (v == 0 and "bandwidth" in key)):
                raise ValueError(f"Cluster.{key}: expected None or a positive number, got {v!r}")
        if self.intra_allreduce_by_size is not None:
            self.intra_allreduce_by_size = _by_size(self.intra_allreduce_by_size)
        if self.link_sharing not in LINK_SHARING:
            raise ValueError(f"Cluster.link_sharing: expected one of {LINK_SHARING}, got {self.link_sharing!r}")

    # ---- topology ------------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return self.servers * self.devices_per_server

    def server_of(self, device: int) -> int:
        if not 0 <= device < self.num_devices:
            raise ValueError(f"device {device} is not in this cluster (ids 0..{self.num_devices - 1})")
        return device // self.devices_per_server

    def servers_of(self, devices: Iterable[int]) -> set[int]:
        return {self.server_of(d) for d in devices}

    def link(self, a: int, b: int) -> tuple[float, float]:
        """(bandwidth B/s, latency s) of the slowest link a transfer from device a to device b crosses."""
        if self.server_of(a) == self.server_of(b):
            return self.intra_bandwidth, self.intra_latency
        return self.inter_bandwidth, self.inter_latency

    def span_link(self, devices: Iterable[int]) -> tuple[float, float]:
        """(bandwidth, latency) of the slowest link a collective over ``devices`` crosses."""
        if len(self.servers_of(devices)) > 1:
            return self.inter_bandwidth, self.inter_latency
        return self.intra_bandwidth, self.intra_latency

    def allreduce_link(self, devices: Iterable[int] | None = None, *, spans_servers: bool | None = None,
                       replicas: int | None = None) -> tuple[float, float]:
        """(bus bandwidth, latency per ring step) of a ring AllReduce over ``devices`` (or, without them, over
        ``replicas`` devices that do or do not span servers): the measured AllReduce numbers where known (inside
        a server, those measured for the group's size, interpolated between measured sizes), else the slowest
        link's."""
        if devices is not None:
            devices = list(devices)
            replicas = len(devices) if replicas is None else replicas
        if spans_servers is None:
            if devices is None:
                raise TypeError("allreduce_link needs devices or spans_servers (both are None)")
            spans_servers = len(self.servers_of(devices)) > 1
        if spans_servers:
            return (self.inter_allreduce_bandwidth or self.inter_bandwidth,
                    self.inter_latency if self.inter_allreduce_latency is None else self.inter_allreduce_latency)
        if self.intra_allreduce_by_size and replicas is not None and replicas > 1:
            return _interpolate(self.intra_allreduce_by_size, replicas)
        return (self.intra_allreduce_bandwidth or self.intra_bandwidth,
                self.intra_latency if self.intra_allreduce_latency is None else self.intra_allreduce_latency)

    def graph(self) -> nx.Graph:
        """The topology: device nodes ``("device", d)`` joined to their ``("server", s)`` switch (intra
        links), servers joined to one ``"network"`` node (inter links); edges carry bandwidth and latency. Edge
        latencies add up along a path to :meth:`link`'s (when ``inter_latency >= intra_latency``)."""
        g = nx.Graph(name=self.name or "cluster")
        g.add_node("network")
        hop = max(0.0, self.inter_latency - self.intra_latency) / 2  # device-server-network-server-device
        for s in range(self.servers):
            g.add_node(("server", s))
            g.add_edge(("server", s), "network", bandwidth=self.inter_bandwidth, latency=hop)
            for i in range(self.devices_per_server):
                d = s * self.devices_per_server + i
                g.add_node(("device", d), server=s)
                g.add_edge(("device", d), ("server", s), bandwidth=self.intra_bandwidth,
                           latency=self.intra_latency / 2)
        return g

    def path(self, a: int, b: int) -> list:
        """The links a transfer from device a to device b crosses, as a node path in :meth:`graph`."""
        return nx.shortest_path(self.graph(), ("device", a), ("device", b))

    # ---- constructors --------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, servers: int | None = None) -> "Cluster":
        """Paper Table 3: "A" 2x8 V100 NVLink + 25 Gbps, "B" 16x1 25 Gbps, "C" 16x1 10 Gbps (16 GB each)."""
        key = str(name).upper()
        if servers is not None:
            positive_int("Cluster.preset: servers", servers)
        if key == "A":
            return cls(servers=servers or 2, devices_per_server=8, intra_bandwidth=130e9, inter_bandwidth=25 * GBPS,
                       intra_latency=5e-6, inter_latency=30e-6, device_memory=16e9, name="A")
        if key in ("B", "C"):
            bw = 25 * GBPS if key == "B" else 10 * GBPS
            return cls(servers=servers or 16, devices_per_server=1, intra_bandwidth=bw, inter_bandwidth=bw,
                       intra_latency=30e-6, inter_latency=30e-6, device_memory=16e9, name=key)
        raise ValueError(f"unknown cluster preset {name!r}; expected 'A', 'B' or 'C' (paper Table 3)")

    @classmethod
    def local(cls, world_size: int, bandwidth: float | None = None, latency: float | None = None,
              device_memory: float | None = None, measure: bool | None = None) -> "Cluster":
        """``world_size`` processes on this machine (one server), for planning a local run.

        Link bandwidth (B/s) and latency (s) are measured by starting ``world_size`` gloo processes (P2P
        ping-pong and AllReduce over several sizes, fitted as latency + bytes / bandwidth) unless both are
        given; ``measure=False`` takes defaults instead of measuring. ``device_memory`` defaults to this
        machine's RAM shared by the processes.
        """
        if not is_int(world_size, 1):
            raise ValueError(f"Cluster.local: world_size must be a positive integer, got {world_size!r}")
        if device_memory is None:
            device_memory = ram_per_process(world_size)
        if measure is None:
            measure = (bandwidth is None or latency is None) and world_size > 1
        if measure:
            from ..profiler.probe.links import probe_local  # torch is imported only when measuring

            cluster = cls.from_probe(probe_local(max(2, world_size)), device_memory=float(device_memory))
            cluster.name = "local"
            if bandwidth is not None:
                cluster.intra_bandwidth = cluster.inter_bandwidth = float(bandwidth)
            if latency is not None:
                cluster.intra_latency = cluster.inter_latency = float(latency)
            return cluster
        bw = bandwidth if bandwidth is not None else 1e9
        lat = latency if latency is not None else 100e-6
        return cls(servers=1, devices_per_server=world_size, intra_bandwidth=bw, inter_bandwidth=bw,
                   intra_latency=lat, inter_latency=lat, device_memory=float(device_memory), name="local",
                   meta={"bandwidth": "given" if bandwidth is not None else "default"})

    @classmethod
    def from_probe(cls, fits: dict, device_memory: float = 16e9) -> "Cluster":
        """A Cluster from :func:`dapple.profiler.probe.links.measure`'s fits (latency s, bandwidth B/s)."""
        intra = fits.get("intra") or fits.get("inter")
        if intra is None:
            raise ValueError(f"probe results hold no link fit (need 'intra' or 'inter'): {sorted(fits)}")
        inter = fits.get("inter") or intra
        ar = fits.get("allreduce")
        ar_intra = fits.get("allreduce_intra") or (ar if fits["servers"] == 1 else None)
        ar_inter = ar if fits["servers"] > 1 else None
        by_size = {int(r): [float(f[0]), float(f[1])] for r, f in (fits.get("allreduce_by_size") or {}).items()}
        meta: dict[str, Any] = {"measured": "dapple probe (P2P ping-pong, ring AllReduce; least squares)",
                "hosts": list(fits.get("hosts", []))}
        sharing = fits.get("link_sharing") or {}
        # the slow links between servers decide most plans: their verdict first; "independent" fits neither model
        found = next((sharing[k]["verdict"] for k in ("inter", "intra") if k in sharing), None)
        if sharing:
            meta["link_sharing_probe"] = {
                k: {"verdict": v["verdict"], "first_over_last": round(v["first_s"] / v["last_s"], 3),
                    "last_over_solo": round(v["last_s"] / v["solo_s"], 3), "bytes": v["bytes"]}
                for k, v in sharing.items()}
        return cls(servers=int(fits["servers"]), devices_per_server=int(fits["devices_per_server"]),
                   intra_bandwidth=float(intra[1]), intra_latency=float(intra[0]), inter_bandwidth=float(inter[1]),
                   inter_latency=float(inter[0]), device_memory=float(device_memory),
                   intra_allreduce_bandwidth=float(ar_intra[1]) if ar_intra else None,
                   intra_allreduce_latency=float(ar_intra[0]) if ar_intra else None,
                   inter_allreduce_bandwidth=float(ar_inter[1]) if ar_inter else None,
                   inter_allreduce_latency=float(ar_inter[0]) if ar_inter else None,
                   intra_allreduce_by_size=by_size or None, meta=meta,
                   link_sharing=found if found in LINK_SHARING else "held")

    # ---- YAML ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {"dapple_cluster": VERSION, **asdict(self)}
        for key in [k for k, v in d.items() if v is None or v == {}]:
            del d[key]
        return d

    def save(self, path: documents.PathLike) -> None:
        documents.dump(self.to_dict(), path)

    @classmethod
    def from_dict(cls, doc: dict, where: str = "Cluster") -> "Cluster":
        f = documents.Fields(doc, where).known("dapple_cluster", *(x.name for x in fields(cls)))
        try:
            return cls(servers=f.number("servers", integer=True, minimum=1),
                       devices_per_server=f.number("devices_per_server", integer=True, minimum=1),
                       intra_bandwidth=f.number("intra_bandwidth"), inter_bandwidth=f.number("inter_bandwidth"),
                       intra_latency=f.number("intra_latency", default=5e-6),
                       inter_latency=f.number("inter_latency", default=30e-6),
                       device_memory=f.number("device_memory", default=16e9), name=str(doc.get("name", "")),
                       meta=f.mapping("meta"),
                       **{k: f.number(k) for k in ("intra_allreduce_bandwidth", "intra_allreduce_latency",
                                                   "inter_allreduce_bandwidth", "inter_allreduce_latency")
                          if doc.get(k) is not None},
                       intra_allreduce_by_size=doc.get("intra_allreduce_by_size"),
                       link_sharing=str(doc.get("link_sharing", "held")))
        except documents.DocumentError:
            raise
        except ValueError as e:
            raise documents.DocumentError(f"{where}: {e}") from e

    @classmethod
    def load(cls, path: documents.PathLike) -> "Cluster":
        return cls.from_dict(documents.load(path, "dapple_cluster", VERSION), where=str(path))

    def __str__(self) -> str:
        gb = 1e9
        return (f"Cluster {self.name or ''}: {self.servers} x {self.devices_per_server} devices, "
                f"intra {self.intra_bandwidth / gb:.3g} GB/s + {self.intra_latency * 1e6:.3g} us, "
                f"inter {self.inter_bandwidth / gb:.3g} GB/s + {self.inter_latency * 1e6:.3g} us, "
                f"{self.device_memory / gb:.3g} GB per device")


def ram_per_process(processes: int) -> float:
    """This machine's RAM in bytes shared by ``processes`` (a CPU process's "device memory")."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / processes


def _by_size(table: object) -> dict[int, list[float]]:
    """``{r: [latency per ring step s, bus bandwidth B/s]}`` checked and normalised (sorted int keys)."""
    where = "Cluster.intra_allreduce_by_size"
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{where}: expected a non-empty mapping {{group size: [latency s, bandwidth B/s]}}, "
                         f"got {table!r:.120}")
    out = {}
    for r, fit in table.items():
        if isinstance(r, bool) or not isinstance(r, (int, str)) or not str(r).isdigit() or int(r) < 2:
            raise ValueError(f"{where}: group sizes must be integers >= 2, got {r!r}")
        if (not isinstance(fit, (list, tuple)) or len(fit) != 2
                or not all(is_real(v) for v in fit)
                or fit[0] < 0 or fit[1] <= 0):
            raise ValueError(f"{where}[{r}]: expected [latency s >= 0, bandwidth B/s > 0], got {fit!r}")
        out[int(r)] = [float(fit[0]), float(fit[1])]
    return dict(sorted(out.items()))


def _interpolate(table: dict[int, list[float]], r: int) -> tuple[float, float]:
    """(bus bandwidth, latency per ring step) for a group of ``r``: the measured size's, linear in r (latency
    and seconds per byte) between measured sizes, the nearest measured size's outside them."""
    sizes = list(table)
    if r <= sizes[0] or r >= sizes[-1]:
        lat, bw = table[sizes[0] if r <= sizes[0] else sizes[-1]]
        return bw, lat
    hi = next(s for s in sizes if s >= r)
    lo = max(s for s in sizes if s <= r)
    if hi == lo:
        return table[lo][1], table[lo][0]
    t = (r - lo) / (hi - lo)
    lat = (1 - t) * table[lo][0] + t * table[hi][0]
    inv = (1 - t) / table[lo][1] + t / table[hi][1]
    return 1.0 / inv, lat
