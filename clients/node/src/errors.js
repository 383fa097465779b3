// One error class for every failed call, with the gymrpc reason read from the status details.
// Servers attach `google.rpc.ErrorInfo` (domain `gymrpc.v1`, a reason such as `STALE_ATTEMPT`)
// and, when a retry later will succeed, `google.rpc.RetryInfo`. Two small messages, decoded
// by hand here so that no googleapis stubs are needed.
import { Code, ConnectError } from "@connectrpc/connect";
import { BinaryReader } from "@bufbuild/protobuf/wire";

/**
 * Node errors that mean "the server is not there (any more)". Connect reports a reset
 * connection as ABORTED (its reading: the client hung up); gRPC, and so the retry rules of
 * every gymrpc client, call a server that died mid-call UNAVAILABLE.
 */
const TRANSPORT_FAILURES = new Set([
  "ECONNRESET",
  "ECONNREFUSED",
  "ENOENT", // a unix socket whose server is gone
  "EPIPE",
  "ERR_HTTP2_GOAWAY_SESSION",
  "ERR_HTTP2_INVALID_SESSION",
  "ERR_HTTP2_SESSION_ERROR",
  "ERR_HTTP2_STREAM_CANCEL",
  "ERR_HTTP2_STREAM_ERROR",
]);

export class GymrpcError extends Error {
  /**
   * @param {string} message
   * @param {{code: Code, reason?: string, metadata?: Record<string, string>, retryDelayMs?: number,
   *   cause?: unknown}} info
   */
  constructor(message, { code, reason, metadata = {}, retryDelayMs, cause }) {
    super(message, { cause });
    this.name = "GymrpcError";
    /** Connect's numeric code; equal to the gRPC status code. */
    this.code = code;
    /** The gRPC name of the code, for example `FAILED_PRECONDITION`. */
    this.codeName = codeName(code);
    /** `ErrorInfo.reason` (for example `STALE_CHECKPOINT`), else the code name. */
    this.reason = reason || this.codeName;
    this.metadata = metadata;
    /** From `RetryInfo`: how long to wait before a retry can succeed. */
    this.retryDelayMs = retryDelayMs;
  }

  toString() {
    return `${this.codeName} ${this.reason}: ${this.message}`;
  }
}

/** `Code.FailedPrecondition` → `FAILED_PRECONDITION`. */
export function codeName(code) {
  return (Code[code] ?? "Unknown").replace(/([a-z])([A-Z])/g, "$1_$2").toUpperCase();
}

/** Any error from a call (or the transport) as a `GymrpcError`. */
export function toGymrpcError(err) {
  if (err instanceof GymrpcError) return err;
  const connectError = ConnectError.from(err);
  let info;
  let retryDelayMs;
  for (const detail of connectError.details) {
    if (!("type" in detail)) continue;
    if (detail.type === "google.rpc.ErrorInfo") info = decodeErrorInfo(detail.value);
    if (detail.type === "google.rpc.RetryInfo") retryDelayMs = decodeRetryDelayMs(detail.value);
  }
  return new GymrpcError(connectError.rawMessage, {
    code: transportFailure(err) ? Code.Unavailable : connectError.code,
    reason: info?.reason,
    metadata: info?.metadata,
    retryDelayMs,
    cause: err,
  });
}

/**
 * When the server's process dies, Node closes the call's HTTP/2 stream with RST_STREAM CANCEL,
 * which Connect reports as CANCELED although nobody cancelled: no status came from a server.
 */
const RESET_BY_TRANSPORT = /^http\/2 stream closed with error code CANCEL /;

function transportFailure(err) {
  if (err instanceof ConnectError && err.code === Code.Canceled && RESET_BY_TRANSPORT.test(err.rawMessage)) return true;
  for (let cause = err, depth = 0; cause instanceof Error && depth < 8; cause = cause.cause, depth++) {
    if (TRANSPORT_FAILURES.has(cause.code)) return true;
  }
  return false;
}

/** `google.rpc.ErrorInfo{1: reason, 2: domain, 3: map<string, string> metadata}`. */
export function decodeErrorInfo(bytes) {
  const info = { reason: "", domain: "", metadata: {} };
  const reader = new BinaryReader(bytes);
  while (reader.pos < reader.len) {
    const [field, wireType] = reader.tag();
    if (field === 1) info.reason = reader.string();
    else if (field === 2) info.domain = reader.string();
    else if (field === 3) {
      const entry = new BinaryReader(reader.bytes());
      let key = "";
      let value = "";
      while (entry.pos < entry.len) {
        const [entryField, entryWire] = entry.tag();
        if (entryField === 1) key = entry.string();
        else if (entryField === 2) value = entry.string();
        else entry.skip(entryWire);
      }
      info.metadata[key] = value;
    } else reader.skip(wireType);
  }
  return info;
}

/** `google.rpc.RetryInfo{1: google.protobuf.Duration{1: seconds, 2: nanos}}`, in milliseconds. */
export function decodeRetryDelayMs(bytes) {
  const reader = new BinaryReader(bytes);
  let ms = 0;
  while (reader.pos < reader.len) {
    const [field, wireType] = reader.tag();
    if (field !== 1) {
      reader.skip(wireType);
      continue;
    }
    const duration = new BinaryReader(reader.bytes());
    while (duration.pos < duration.len) {
      const [durationField, durationWire] = duration.tag();
      if (durationField === 1) ms += Number(duration.int64()) * 1000;
      else if (durationField === 2) ms += duration.int32() / 1e6;
      else duration.skip(durationWire);
    }
  }
  return ms;
}
