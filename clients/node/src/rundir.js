// The run folder `gymrpc up` writes: the registry address, the stack token and (with --tls)
// where the stack's CA and the client certificate are.
// Same lookup as the Python client: $GYMRPC_RUN_DIR or ./.gymrpc, overridden by
// $GYMRPC_REGISTRY and $GYMRPC_TOKEN.
import { existsSync, readFileSync } from "node:fs";
import path from "node:path";

export const REGISTRY_FILE = "registry.addr";
export const TOKEN_FILE = "token";
export const STATE_FILE = "stack.json";
/** Written by `gymrpc up` when the stack speaks TLS: CA, client certificate and key paths. */
export const TLS_FILE = "tls.json";

/** `$GYMRPC_RUN_DIR`, else `.gymrpc` under the current directory. */
export function defaultRunDir() {
  return path.resolve(process.env.GYMRPC_RUN_DIR || ".gymrpc");
}

/**
 * Where a stack is and how to control it.
 * @param {string} [dir] run folder (default `defaultRunDir()`)
 * @param {{registry?: string}} [known] a registry address given by the caller wins
 * @returns {{dir: string, registry: string, token: string | undefined, tls: object | undefined}}
 */
export function readRunDir(dir = defaultRunDir(), { registry = process.env.GYMRPC_REGISTRY } = {}) {
  if (!registry) {
    const file = path.join(dir, REGISTRY_FILE);
    if (!existsSync(file)) {
      throw new Error(`no stack found: ${file} does not exist; start one with \`gymrpc up\` or set $GYMRPC_REGISTRY`);
    }
    registry = readFileSync(file, "utf8").trim();
  }
  let token = process.env.GYMRPC_TOKEN;
  const tokenFile = path.join(dir, TOKEN_FILE);
  if (!token && existsSync(tokenFile)) token = readFileSync(tokenFile, "utf8").trim();
  const tlsFile = path.join(dir, TLS_FILE);
  const tls = existsSync(tlsFile) ? JSON.parse(readFileSync(tlsFile, "utf8")) : undefined;
  return { dir, registry, token: token || undefined, tls };
}
