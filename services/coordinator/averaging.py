"""Averaging rounds, coordinator side: name a round and tell each member its place.

Control messages only: the members move the tensors among themselves (butterfly
all-reduce, see the stage server's ``averaging.py``). Every member gets the same member
list, so a member that refuses or cannot be reached stays in the list as a failed member:
the others leave it out of the round when it does not answer them, and nobody waits on it
past ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import uuid

import aiohttp

from shared.codec import FLOAT_CODECS
from shared.errors import RemoteError
from shared.http import post_message
from shared.log import get_logger

START_TIMEOUT_S = 5.0  # cap on each /average/start call (a member answers it at once)


async def start_round(session: aiohttp.ClientSession, stage: int, member_urls: list[str], *, codec: str, timeout_s: float, log=None) -> str:
    """Start one averaging round of ``stage`` among ``member_urls`` (index = position); return its id.

    Posts ``/average/start`` to every member at once; members that refuse (e.g. 409: busy
    with a round, or another stage now) or cannot be reached are logged
    (``averaging.start.refused``) and left out of the round.
    """
    if not member_urls:
        raise ValueError("an averaging round needs at least one member")
    if codec not in FLOAT_CODECS:
        raise ValueError(f"averaging codec must be one of {FLOAT_CODECS}, got {codec!r}")
    if not timeout_s > 0:
        raise ValueError(f"averaging timeout_s must be > 0, got {timeout_s}")
    log = log or get_logger(service="coordinator")
    members = [url.rstrip("/") for url in member_urls]
    round_id = f"avg-s{stage}-{uuid.uuid4().hex[:12]}"

    async def tell(index: int, url: str) -> bool:
        msg = {"round_id": round_id, "stage": stage, "members": members, "index": index, "codec": codec, "timeout_s": timeout_s}
        try:
            await post_message(session, url + "/average/start", msg, timeout_s=min(START_TIMEOUT_S, timeout_s))
            return True
        except RemoteError as exc:
            log.warning("averaging.start.refused", round_id=round_id, stage=stage, member=url, index=index, status=exc.status, code=exc.code, reason=exc.message)
            return False

    accepted = await asyncio.gather(*(tell(i, url) for i, url in enumerate(members)))
    log.info("averaging.round.started", round_id=round_id, stage=stage, members=len(members), accepted=sum(accepted), codec=codec, timeout_s=timeout_s)
    return round_id
