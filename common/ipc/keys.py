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
from pathlib import Path
from types import MappingProxyType

import zmq

KEYS_ENV = "SPILLWAY_CONTROL_KEYS"
"""The environment variable that carries a process's `ControlKeys` (`to_json`)."""
KEYS_FILE_ENV = "SPILLWAY_CONTROL_KEYS_FILE"
"""Or the path of a file (mode 0600, `write_keys`) that holds them: containers, which no launcher starts."""
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
        """The keys `KEYS_ENV` carries, or those of the file `KEYS_FILE_ENV` names, or None where neither is
        set (the control plane then runs without CurveZMQ: ipc:// sockets in the private run directory
        only)."""
        text = environ.get(KEYS_ENV)
        path = environ.get(KEYS_FILE_ENV)
        if not text and path:
            text = Path(path).read_text()
        return cls.from_json(text) if text else None


def make_keys(names: Iterable[str]) -> dict[str, ControlKeys]:
    """A fresh key pair for each of `names` (services, and `LAUNCHER`): each process's `ControlKeys`."""
    pairs = {name: zmq.curve_keypair() for name in names}
    public = {name: pub for name, (pub, _) in pairs.items()}
    return {name: ControlKeys(name, secret, public) for name, (_, secret) in pairs.items()}


def write_keys(directory: str | Path, names: Iterable[str]) -> dict[str, Path]:
    """Fresh keys for `names` (`make_keys`), each process's in `directory/NAME.json` (mode 0600, the
    directory 0700): the file `KEYS_FILE_ENV` names for a service that no launcher starts."""
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = {}
    for name, keys in make_keys(names).items():
        path = directory / f"{name}.json"
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(keys.to_json())
        paths[name] = path
    return paths


def keys_env(keys: ControlKeys | None) -> dict[str, str]:
    """The environment entries that hand `keys` to a child process (none for None)."""
    return {KEYS_ENV: keys.to_json()} if keys is not None else {}
