"""The control plane's keys: a CurveZMQ key pair for each service (and the launcher), made at start by the
launcher and handed to each process in its environment (`KEYS_ENV`, never on a command line).

A process holds its own secret key and every service's public key: its inbox admits only connections whose
client key is one of those (common/ipc/transport.py), and tells each message's sender by it, so that a
message is accepted only from a role that may send it (`common.protocol.may_send`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import zmq

KEYS_ENV = "SPILLWAY_CONTROL_KEYS"
"""The environment variable that carries a process's `ControlKeys` (`to_json`)."""
LAUNCHER = "launcher"
"""The name the launcher (or a Ray pair host) speaks as: the only sender of `ServiceDown`."""


@dataclass(frozen=True)
class ControlKeys:
    """One process's identity on the control plane: its service `name`, its CurveZMQ secret key and every
    known service's public key by name (its own among them), all Z85 text (40 characters)."""

    name: str
    secret: bytes = field(repr=False)
    public: Mapping[str, bytes]

    def __post_init__(self) -> None:
        object.__setattr__(self, "public", MappingProxyType(dict(self.public)))
        if self.name not in self.public:
            raise ValueError(f"the keys of {self.name!r} lack its own public key")

    @property
    def own_public(self) -> bytes:
        return self.public[self.name]

    def server_key(self, peer: str) -> bytes:
        """The public key of the service `peer` (whose inbox this process connects to)."""
        try:
            return self.public[peer]
        except KeyError:
            raise ValueError(f"no public key for {peer!r} among {sorted(self.public)}") from None

    def to_json(self) -> str:
        public = {name: key.decode() for name, key in self.public.items()}
        return json.dumps({"name": self.name, "secret": self.secret.decode(), "public": public})

    @classmethod
    def from_json(cls, text: str) -> ControlKeys:
        data = json.loads(text)
        public = {name: key.encode() for name, key in data["public"].items()}
        return cls(data["name"], data["secret"].encode(), public)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ControlKeys | None:
        """The keys `KEYS_ENV` carries, or None where it is unset (the control plane then runs without
        CurveZMQ: ipc:// sockets in the private run directory only)."""
        text = environ.get(KEYS_ENV)
        return cls.from_json(text) if text else None


def make_keys(names: Iterable[str]) -> dict[str, ControlKeys]:
    """A fresh key pair for each of `names` (services, and `LAUNCHER`): each process's `ControlKeys`."""
    pairs = {name: zmq.curve_keypair() for name in names}
    public = {name: pub for name, (pub, _) in pairs.items()}
    return {name: ControlKeys(name, secret, public) for name, (_, secret) in pairs.items()}


def keys_env(keys: ControlKeys | None) -> dict[str, str]:
    """The environment entries that hand `keys` to a child process (none for None)."""
    return {KEYS_ENV: keys.to_json()} if keys is not None else {}
