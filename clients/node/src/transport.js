// gRPC transports for the targets gymrpc registers: `host:port`, `unix:/path`, `unix-abstract:name`.
// Connect speaks the gRPC protocol over Node's http2; a unix socket is reached by handing
// http2 a socket of our own, so the registry's socket needs no TCP port.
import net from "node:net";
import { createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";

/** Same limit as the Python servers (`gymrpc.channels.MAX_MESSAGE_BYTES`): snapshots reach a few MB. */
export const MAX_MESSAGE_BYTES = 64 * 1024 * 1024;

/**
 * A transport to one target, and a way to close its connection.
 * @param {string} target `host:port`, `[v6]:port`, `unix:/abs/path`, `unix:///abs/path` or `unix-abstract:name`
 * @param {{interceptors?: import("@connectrpc/connect").Interceptor[]}} [options]
 */
export function connect(target, { interceptors = [] } = {}) {
  let baseUrl = `http://${target}`;
  let nodeOptions = {};
  const socket = socketPath(target);
  if (socket !== undefined) {
    baseUrl = "http://localhost";
    nodeOptions = { createConnection: () => net.connect(socket) };
  }
  const sessions = new Http2SessionManager(baseUrl, { idleConnectionTimeoutMs: 60_000 }, nodeOptions);
  const transport = createGrpcTransport({
    baseUrl,
    sessionManager: sessions,
    interceptors,
    readMaxBytes: MAX_MESSAGE_BYTES,
    writeMaxBytes: MAX_MESSAGE_BYTES,
  });
  return { transport, close: () => sessions.abort() };
}

/** The socket path of a unix target, undefined for a TCP one. */
export function socketPath(target) {
  if (target.startsWith("unix-abstract:")) return "\0" + target.slice("unix-abstract:".length);
  if (target.startsWith("unix://")) return target.slice("unix://".length);
  if (target.startsWith("unix:")) return target.slice("unix:".length);
  return undefined;
}
