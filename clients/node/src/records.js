// Reading a committed checkpoint from another language: each participant's records file is a
// sequence of length-delimited `gymrpc.v1.CheckpointRecord` messages, described by its
// manifest (sha256, size and record count over the whole file), which is written last.
import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import path from "node:path";
import { fromBinary } from "@bufbuild/protobuf";
import { BinaryReader } from "@bufbuild/protobuf/wire";
import { CheckpointRecordSchema } from "../gen/gymrpc/v1/checkpoint_records_pb.js";
import { manifestPath } from "./checkpoints.js";

/**
 * The records one participant committed, checked against its manifest.
 * @param {string} checkpointDir the checkpoint's folder (`<root>/<checkpoint_id>`)
 * @param {{kind: number, name: string, endpointId: string, recordsFile: string, sha256: string,
 *   recordCount: bigint}} manifest from `CommitResponse.manifest`; the file is
 *   `<checkpointDir>/<kind>/<instance>[#<endpointId>]/<recordsFile>`
 */
export function readRecords(checkpointDir, manifest) {
  const where = manifestPath(manifest.kind, manifest.name, manifest.endpointId);
  const folder = path.dirname(path.join(checkpointDir, where));
  const bytes = readFileSync(path.join(folder, manifest.recordsFile));
  const sha256 = createHash("sha256").update(bytes).digest("hex");
  if (sha256 !== manifest.sha256) throw new Error(`${manifest.name}: records sha256 ${sha256} != manifest's`);
  const records = [];
  const reader = new BinaryReader(bytes);
  while (reader.pos < reader.len) records.push(fromBinary(CheckpointRecordSchema, reader.bytes()));
  if (BigInt(records.length) !== BigInt(manifest.recordCount)) {
    throw new Error(`${manifest.name}: ${records.length} records, the manifest says ${manifest.recordCount}`);
  }
  return records;
}
