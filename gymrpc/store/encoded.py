"""An episode record that keeps its history encoded: a save costs the boundary's change, not the episode's past.

The agent saves its record at every boundary, and the record's history only grows:
messages, model calls (each with its prompt's token ids) and tool calls, plus the session
snapshot, which changes at tool boundaries only. Serialising the record as a message
re-encodes all of it at each boundary: O(history) per boundary, O(history²) per episode
(1.3 ms per boundary with ten 16k-token prompts, bench/store.py). `EncodedCheckpoint` is
the same record with those fields declared bytes: an entry is encoded once, when it is
appended, and a save copies bytes. A length-delimited field is a message or bytes alike on
the wire, so its deterministic serialisation is byte-identical to `EpisodeCheckpoint`'s:
the stores, the log's deltas and every reader are unchanged, and either type parses the
other's bytes.
"""

from __future__ import annotations

from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from gymrpc.v1 import episode_checkpoint_pb2 as ckpt_pb

HISTORY = ("messages", "model_calls", "tool_calls")
"""The append-only lists, each entry held as its encoded message."""
SNAPSHOT = "resource_snapshot"
"""The session snapshot, held as its encoded `SessionSnapshot` (with presence, as the message has)."""


def _twin() -> type[Message]:
    original = ckpt_pb.EpisodeCheckpoint.DESCRIPTOR
    source = descriptor_pb2.FileDescriptorProto()
    original.file.CopyToProto(source)
    twin = descriptor_pb2.FileDescriptorProto(
        name="gymrpc_encoded/episode_checkpoint.proto",
        package="gymrpc_encoded",
        syntax=source.syntax,
        dependency=[source.name, *source.dependency],
    )
    message = twin.message_type.add()
    message.CopyFrom(next(m for m in source.message_type if m.name == original.name))
    for field in message.field:
        if field.name not in (*HISTORY, SNAPSHOT):
            continue
        field.type = FieldDescriptor.TYPE_BYTES
        field.ClearField("type_name")
        if field.name == SNAPSHOT:
            field.proto3_optional = True  # an empty snapshot set is written, as the message field writes it
            field.oneof_index = len(message.oneof_decl)
            message.oneof_decl.add(name=f"_{SNAPSHOT}")
    pool = descriptor_pool.Default()  # the original's nested types (EpisodeId, Usage, ...) resolve there
    pool.Add(twin)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"gymrpc_encoded.{original.name}"))


EncodedCheckpoint = _twin()
_TYPE_URL = f"type.googleapis.com/{ckpt_pb.EpisodeCheckpoint.DESCRIPTOR.full_name}"


def encoded(record: ckpt_pb.EpisodeCheckpoint) -> Message:
    """`record` as an `EncodedCheckpoint` (a record loaded from a store, about to be saved again)."""
    return EncodedCheckpoint.FromString(record.SerializeToString(deterministic=True))


def pack(into: any_pb2.Any, record: Message) -> None:
    """`Any.Pack` for a record of either type: an `EncodedCheckpoint` is packed as the `EpisodeCheckpoint` it is."""
    into.type_url = _TYPE_URL
    into.value = record.SerializeToString(deterministic=True)


def decoded(record: Message) -> ckpt_pb.EpisodeCheckpoint:
    """An `EncodedCheckpoint` as the `EpisodeCheckpoint` it stands for (to restore state from it)."""
    return ckpt_pb.EpisodeCheckpoint.FromString(record.SerializeToString(deterministic=True))


__all__ = ["HISTORY", "SNAPSHOT", "EncodedCheckpoint", "decoded", "encoded", "pack"]
