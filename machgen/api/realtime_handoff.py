"""Handing a realtime session to another connection (docs/http-api.md, "Realtime video": ``session.handoff``
and ``session.claim``, ours). The owning connection trades a session for a one-time token: it stops streaming
the session (its stream on Triton ends as a client's close ends it, the session left open there) and no longer
holds it. Another connection of the same key that brings the token gets the session, playing on from where it
is. The token is random (192 bits), good once, and expires; a session never claimed is stopped on the server
when its token expires, so nothing is left open that no one can reach. Until then its seat under the key's cap
(--max-sessions-per-key) stays taken."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field

from machgen.api.realtime import Fields, RealtimeError, RealtimeParts, Session, encoder_for, invalid

log = logging.getLogger("machgen.api.realtime")
HANDOFF_TTL_S = 60  # long enough to pass a token to another device or process, short enough to hold little
MAX_HANDOFF_TTL_S = 600
STOP_TIMEOUT_S = 10.0
# How long a claimed or expired token is still told apart from one never issued (then: unknown).
SPENT_REMEMBERED_S = 3600.0


@dataclass
class Ticket:
    session: Session
    owner: str
    ttl_s: int
    triton_url: str
    expires_at: float  # time.time()
    timer: asyncio.Task | None = field(default=None, repr=False)


def refused(message: str) -> RealtimeError:
    return RealtimeError("invalid_handoff", message, "token")


class Handoffs:
    """The API process's sessions handed off and not yet claimed, by token."""

    def __init__(self, parts: RealtimeParts):
        self.parts = parts
        self.tickets: dict[str, Ticket] = {}
        self.spent: dict[str, tuple[str, float]] = {}  # token: ("claimed" | "expired", when)

    def issue(self, session: Session, owner: str, ttl_s: int, triton_url: str,
) -> tuple[str, Ticket]:
        now = time.time()
        self.spent = {token: spent for token, spent in self.spent.items() if now - spent[1] < SPENT_REMEMBERED_S}
        token = "mgh_" + secrets.token_urlsafe(24)
        ticket = Ticket(session, owner, ttl_s, triton_url, now + ttl_s)
        ticket.timer = asyncio.create_task(self._expire(token, ticket))
        self.tickets[token] = ticket
        return token, ticket

    def find(self, token: str, owner: str) -> Ticket:
        """The ticket ``owner`` may claim with ``token``, or the refusal naming the token."""
        ticket = self.tickets.get(token)
        if ticket is None:
            spent = self.spent.get(token)
            if spent is None:
                raise refused("this server issued no such handoff token (a token is good in the API process "
                              "that issued it)")
            if spent[0] == "claimed":
                raise refused("this handoff token was claimed already: a token is good once")
            raise refused("this handoff token expired unclaimed, and its session was stopped")
        if ticket.owner != owner:
            self.parts.metrics.refused.labels("handoff_key").inc()
            raise refused("this handoff token is another API key's: claim it with the key that handed the session "
                          "off")
        return ticket

    def take(self, token: str) -> Ticket:
        """The ticket claimed: its token spent, its session (and seat) now the claimer's."""
        ticket = self.tickets.pop(token)
        ticket.timer.cancel()
        self.spent[token] = ("claimed", time.time())
        return ticket

    async def _expire(self, token: str, ticket: Ticket) -> None:
        await asyncio.sleep(max(0.0, ticket.expires_at - time.time()))
        if self.tickets.get(token) is not ticket:
            return
        del self.tickets[token]
        self.spent[token] = ("expired", time.time())
        await self._stop(ticket)
        log.info("session %s: handed off and not claimed in %d s; stopped", ticket.session.name, ticket.ttl_s)

    async def _stop(self, ticket: Ticket) -> None:
        try:
            await stop_on_server(ticket.triton_url, ticket.session)
        except Exception:  # noqa: BLE001 - closed already (idle), or Triton gone: nothing left to give back
            log.debug("session %s: not stopped on the server", ticket.session.name, exc_info=True)
        self.parts.release(ticket.owner, ticket.session.model.name)

    async def close(self) -> None:
        """The API process's end: every unclaimed session stopped."""
        tickets, self.tickets = list(self.tickets.values()), {}
        for ticket in tickets:
            ticket.timer.cancel()
            await self._stop(ticket)


async def stop_on_server(triton_url: str, session: Session) -> None:
    """``stop`` for a session no connection holds (on a client of its own: the connection that handed it off
    may be gone)."""
    import tritonclient.grpc.aio as grpcaio

    from machgen.api.triton import TritonModels
    from machgen.contract.sessions import SESSION_INPUT, SESSION_OP_INPUT

    client = grpcaio.InferenceServerClient(triton_url)
    try:
        tensors = [TritonModels.tensor(session.model, name, value)
                   for name, value in ((SESSION_INPUT, session.triton_id), (SESSION_OP_INPUT, "stop"))]
        await client.infer(session.model.name, tensors, client_timeout=STOP_TIMEOUT_S)
    finally:
        await client.close()


class HandoffMessages:
    """``session.handoff`` and ``session.claim``, messages of routes/realtime.py's Connection (whose sessions,
    sending and playing they use)."""

    async def handoff(self, fields: Fields) -> None:
        session = self._session(fields.name("session"))
        ttl_s = fields.integer("expires_in", 1, MAX_HANDOFF_TTL_S) or HANDOFF_TTL_S
        fields.finish()
        await self._opened(session)
        if session.stopping:
            raise RealtimeError("invalid_value", f"session {session.name!r} is being stopped", "session",
                                session.name)
        if session.stream is not None and not session.stream.done():
            # Its play on Triton ends too; the sampler keeps the chunk it was making for the claimer's play.
            async with self.send_lock:  # so that no chunk is cut between its metadata and its binary messages
                session.stream.cancel()
            await asyncio.gather(session.stream, return_exceptions=True)
        if self.sessions.get(session.name) is not session:  # its stream ended it meanwhile, and said so
            raise RealtimeError("session_not_found", f"session {session.name!r} ended before it was handed off",
                                "session", session.name)
        del self.sessions[session.name]  # its seat under the key's cap goes with the token
        token, ticket = self.handoffs.issue(session, self.owner, ttl_s, self.state.triton.url)
        await self.send({"type": "session.handed_off", "request_id": session.name, "session": session.name,
                         "token": token, "expires_in": ttl_s, "expires_at": int(ticket.expires_at),
                         "chunk": session.next_chunk})

    async def claim(self, fields: Fields) -> None:
        token = fields.text("token", "the token that session.handoff answered", limit=100)
        ticket = self.handoffs.find(token, self.owner)
        handed = ticket.session
        name = fields.name("session") or handed.name
        format_given = "format" in fields.values or "lossless" in fields.values
        output_format, lossless = self._format(fields)
        if not format_given:
            output_format, lossless = handed.output_format, handed.lossless
        chunks = self._chunks(fields, handed.realtime, from_start=False)
        fields.finish()
        if name in self.sessions:
            raise invalid("session", f"this connection already has a session {name!r}: name the claimed one "
                                     "('session')")
        self.handoffs.take(token)
        session = Session(name, handed.triton_id, handed.model, handed.realtime, handed.width, handed.height,
                          output_format, lossless,
                          encoder_for(output_format, handed.width, handed.height, handed.realtime.fps, lossless),
                          time.monotonic(), next_chunk=handed.next_chunk)
        session.opened.set()
        self.sessions[name] = session
        await self._announce(session, claimed=True)
        session.stream = asyncio.create_task(self._stream(session, "play", chunks, {}))
