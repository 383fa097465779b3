// gRPC transports for the targets gymrpc registers: `host:port`, `unix:/path`, `unix-abstract:name`.
// Connect speaks the gRPC protocol over Node's http2; a unix socket is reached by handing
// http2 a socket of our own, so the registry's socket needs no TCP port.
import { readFileSync } from "node:fs";
import net from "node:net";
import tls from "node:tls";
import { createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";

/** Same limit as the Python servers (`gymrpc.channels.MAX_MESSAGE_BYTES`): snapshots reach a few MB. */
export const MAX_MESSAGE_BYTES = 64 * 1024 * 1024;

/**
 * A transport to one target, and a way to close its connection.
 * @param {string} target `host:port`, `[v6]:port`, `unix:/abs/path`, `unix:///abs/path` or `unix-abstract:name`
 * @param {{interceptors?: import("@connectrpc/connect").Interceptor[], tls?: TlsFiles}} [options]
 *   `tls`: speak TLS (mTLS with a client certificate), as a stack started with `gymrpc up --tls` needs.
 */
export function connect(target, { interceptors = [], tls: files } = {}) {
  const secure = files ? tlsOptions(files) : undefined;
  const scheme = secure ? "https" : "http";
  let baseUrl = `${scheme}://${target}`;
  let nodeOptions = secure ?? {};
  const socket = socketPath(target);
  if (socket !== undefined) {
    baseUrl = `${scheme}://localhost`;
    nodeOptions = {
      createConnection: secure
        ? () => tls.connect({ ...secure, socket: net.connect(socket), servername: secure.servername ?? "localhost" })
        : () => net.connect(socket),
    };
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

/**
 * @typedef {{ca?: string, cert?: string, key?: string, server_name?: string}} TlsFiles
 * Paths of the CA that signs the servers' certificates, the client's certificate and key (mTLS),
 * and the name to check in server certificates (default: the target's host); the run folder's
 * `tls.json` has this shape.
 */

/** Node's TLS options from `TlsFiles`: files read once, h2 by ALPN. */
export function tlsOptions(files) {
  const read = (file) => (file ? readFileSync(file) : undefined);
  const options = { ca: read(files.ca), cert: read(files.cert), key: read(files.key), ALPNProtocols: ["h2"] };
  if (files.server_name) options.servername = files.server_name;
  return options;
}

/** The socket path of a unix target, undefined for a TCP one. */
export function socketPath(target) {
  if (target.startsWith("unix-abstract:")) return "\0" + target.slice("unix-abstract:".length);
  if (target.startsWith("unix://")) return target.slice("unix://".length);
  if (target.startsWith("unix:")) return target.slice("unix:".length);
  return undefined;
}
