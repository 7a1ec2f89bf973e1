"""Zero-configuration discovery on a LAN with mDNS (zeroconf's asyncio API).

The coordinator announces ``_swarm-coord._tcp`` (not ``_swarm-coordinator``:
RFC 6763 limits service names to 15 bytes) and stage servers announce
``_swarm-stage._tcp``, each with TXT properties (``run_id``, ``stage``, ``version``, and
always ``url``). A service started without a coordinator URL finds one with
:func:`find_coordinator`; a trainer may :func:`browse` stage servers while the
coordinator is away.

mDNS gives addresses only, never liveness: zeroconf keeps a record for many minutes after
a peer is killed without saying goodbye, so a browsed URL may point at a dead process.
Whether a server is alive comes from the coordinator's leases (heartbeats) alone.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import socket
from urllib.parse import urlsplit

from zeroconf import InterfaceChoice, IPVersion, ServiceStateChange
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from shared.log import get_logger

COORDINATOR_TYPE = "_swarm-coord._tcp.local."
STAGE_TYPE = "_swarm-stage._tcp.local."

# Probing takes 1.2-1.6 s and goodbyes ~0.3 s; these bound the announcer's awaits.
REGISTER_TIMEOUT_S = 10.0
UNREGISTER_TIMEOUT_S = 5.0

log = get_logger()


def parse_interfaces(spec: str) -> InterfaceChoice | list[str]:
    """``SWARM_MDNS_INTERFACES``: ``"all"`` or comma-separated IPv4 addresses of local interfaces."""
    if spec.strip().lower() == "all":
        return InterfaceChoice.All
    addresses = [part.strip() for part in spec.split(",") if part.strip()]
    if not addresses:
        raise ValueError(f"SWARM_MDNS_INTERFACES must be 'all' or comma-separated IPv4 addresses, got {spec!r}")
    try:
        return [str(ipaddress.IPv4Address(a)) for a in addresses]
    except ValueError as exc:
        raise ValueError(
            f"SWARM_MDNS_INTERFACES must be 'all' or comma-separated IPv4 addresses, got {spec!r}: {exc}"
        ) from None


def _zeroconf(interfaces: InterfaceChoice | list[str]) -> AsyncZeroconf:
    return AsyncZeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only)


async def _announced_address(url: str) -> tuple[ipaddress.IPv4Address, int]:
    """The IPv4 address and port others reach ``url`` (``http://HOST:PORT``) at."""
    parts = urlsplit(url)
    if not parts.hostname or parts.port is None:
        raise ValueError(f"cannot announce {url!r}: expected http://HOST:PORT")
    try:
        address = ipaddress.ip_address(parts.hostname)
    except ValueError:  # a host name: announce what it resolves to
        loop = asyncio.get_running_loop()
        resolved = await asyncio.wait_for(
            loop.run_in_executor(None, socket.gethostbyname, parts.hostname), REGISTER_TIMEOUT_S
        )
        address = ipaddress.ip_address(resolved)
    if not isinstance(address, ipaddress.IPv4Address):
        raise ValueError(f"cannot announce {url!r}: mDNS announces IPv4 addresses only")
    if address.is_unspecified:
        raise ValueError(f"cannot announce {url!r}: nobody can reach {address}; set SWARM_ADVERTISE_URL")
    return address, parts.port


def _dns_label(name: str) -> str:
    """``name`` as a DNS label (at most 63 bytes): a long one is cut and made unique by a hash."""
    if len(name.encode()) <= 63:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    return name.encode()[:52].decode("ascii", "ignore") + "-" + digest


class Announcer:
    """Announces one service by mDNS from ``start`` until ``stop`` (which sends the goodbye).

    Use as ``async with Announcer(spec) as announcer: await announcer.start(...)``.
    """

    def __init__(self, interfaces_spec: str):
        self._interfaces = parse_interfaces(interfaces_spec)
        self._azc: AsyncZeroconf | None = None
        self._info: AsyncServiceInfo | None = None

    async def start(self, service_type: str, instance_name: str, url: str, properties: dict[str, str]) -> None:
        """Register ``instance_name`` of ``service_type`` at ``url``'s address and port; TXT = properties + url."""
        assert self._azc is None, "an Announcer announces one service; stop it before starting again"
        address, port = await _announced_address(url)
        self._info = AsyncServiceInfo(
            service_type,
            f"{_dns_label(instance_name)}.{service_type}",
            addresses=[address.packed],
            port=port,
            properties={**properties, "url": url},
        )
        self._azc = _zeroconf(self._interfaces)
        # The first await queues the registration; the second waits for probing and announcing.
        registered = await self._azc.async_register_service(self._info, allow_name_change=True)
        await asyncio.wait_for(registered, REGISTER_TIMEOUT_S)
        log.info("mdns.announced", service=self._info.name, url=url)

    async def stop(self) -> None:
        """Withdraw the service (goodbye packets) and close zeroconf; a no-op when not started."""
        azc, info = self._azc, self._info
        self._azc = self._info = None
        if azc is None:
            return
        try:
            if info is not None:
                # Without awaiting the returned awaitable no goodbye is sent.
                goodbye = await azc.async_unregister_service(info)
                await asyncio.wait_for(goodbye, UNREGISTER_TIMEOUT_S)
                log.info("mdns.withdrawn", service=info.name)
        finally:
            await azc.async_close()

    async def __aenter__(self) -> Announcer:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.stop()


async def _resolve(zc, service_type: str, name: str, timeout_s: float) -> dict | None:
    """``{"name", "url", "properties"}`` of one browsed service, or None if unresolved or url-less."""
    info = AsyncServiceInfo(service_type, name)
    if not await info.async_request(zc, timeout_s * 1000):  # zeroconf counts milliseconds
        log.debug("mdns.resolve.timeout", service=name)
        return None
    properties = {k: v or "" for k, v in info.decoded_properties.items()}
    if not properties.get("url"):
        log.debug("mdns.resolve.no_url", service=name)
        return None
    return {"name": name, "url": properties["url"], "properties": properties}


def _matches(record: dict, match: dict[str, str] | None) -> bool:
    return all(record["properties"].get(k) == v for k, v in (match or {}).items())


async def browse(
    service_type: str,
    *,
    interfaces_spec: str,
    timeout_s: float,
    match: dict[str, str] | None = None,
    first_only: bool = True,
) -> list[dict]:
    """Services of ``service_type`` whose TXT properties contain every item of ``match``.

    Returns records ``{"name", "url", "properties"}``: the first match as soon as it is
    resolved when ``first_only``, otherwise every match seen within ``timeout_s``; ``[]``
    when none is found in time. The whole call takes at most about ``timeout_s``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    azc = _zeroconf(parse_interfaces(interfaces_spec))
    resolved: asyncio.Queue[dict | None] = asyncio.Queue()
    resolving: set[asyncio.Task] = set()

    async def resolve_into_queue(name: str) -> None:
        try:
            await resolved.put(await _resolve(azc.zeroconf, service_type, name, max(0.0, deadline - loop.time())))
        except Exception as exc:  # a malformed record from some peer must not end the browse
            log.warning("mdns.resolve.failed", service=name, error=repr(exc))
            await resolved.put(None)

    def on_change(zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is not ServiceStateChange.Removed:  # Added, or Updated (new TXT)
            task = asyncio.ensure_future(resolve_into_queue(name))
            resolving.add(task)
            task.add_done_callback(resolving.discard)

    records: dict[str, dict] = {}  # by service name: the latest resolution wins
    browser = AsyncServiceBrowser(azc.zeroconf, service_type, handlers=[on_change])
    try:
        while (remaining := deadline - loop.time()) > 0:
            try:
                record = await asyncio.wait_for(resolved.get(), remaining)
            except asyncio.TimeoutError:
                break
            if record is None:
                continue
            records[record["name"]] = record
            if first_only and _matches(record, match):
                return [record]
        return [r for r in records.values() if _matches(r, match)]
    finally:
        await browser.async_cancel()
        for task in list(resolving):
            task.cancel()
        await asyncio.gather(*resolving, return_exceptions=True)
        await azc.async_close()


async def find_coordinator(run_id: str | None, *, interfaces_spec: str, timeout_s: float) -> str | None:
    """URL of a coordinator announcing ``run_id`` (any run if None), or None if none answers in time."""
    match = {"run_id": run_id} if run_id is not None else None
    records = await browse(COORDINATOR_TYPE, interfaces_spec=interfaces_spec, timeout_s=timeout_s, match=match)
    return records[0]["url"] if records else None
