"""What every route reaches through its request: the API process's settings and parts (job store, Triton,
keys, webhooks, jobs, URL signer), made by app.py's lifespan."""

from __future__ import annotations

from dataclasses import dataclass, field

from machgen.api.jobs import JobManager
from machgen.api.keys import KeyRing, UrlSigner
from machgen.api.settings import ApiSettings
from machgen.api.store import JobStore
from machgen.api.triton import TritonModels
from machgen.api.webhooks import WebhookSender


@dataclass
class ApiState:
    settings: ApiSettings
    store: JobStore
    triton: TritonModels
    keys: KeyRing
    webhooks: WebhookSender
    jobs: JobManager
    signer: UrlSigner
    tasks: list = field(default_factory=list)


def state_of(request) -> ApiState:
    return request.app.state.machgen
