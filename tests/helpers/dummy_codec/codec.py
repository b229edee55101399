"""The `dummy` codec on the wire: `none`'s payload under its own name."""

from __future__ import annotations

from helpers.dummy_codec.params import DummyParams

from nebula_cli.codecs.none.codec import NoneCodec


class DummyCodec(NoneCodec):
    """fp32 as is, named `dummy`."""

    Params = DummyParams

    def __init__(self, dummy_copies: int = DummyParams.dummy_copies) -> None:
        self.copies = dummy_copies


CODECS = (DummyCodec,)
