// gymrpc controller library for Node: stable names, episodes, coordinated checkpoints.
export { GymClient, CONTROL_SERVICES, DEFAULT_TIMEOUT_MS, ENDPOINT_ID, RUN_TIMEOUT_MS } from "./client.js";
export { INDEX, compareIds, indexSources, manifestPath, readIndex, writeIndex } from "./checkpoints.js";
export {
  Controller,
  CoordinationError,
  PrepareResult,
  PREPARE_ORDER,
  RESUME_ORDER,
  RETIRE_ORDER,
  episodeId,
  key,
  memberLabel,
  newCheckpointId,
} from "./controller.js";
export { GymrpcError, toGymrpcError, codeName } from "./errors.js";
export { readRunDir, defaultRunDir } from "./rundir.js";
export { taskFromRow, canonicalJson } from "./tasks.js";
export { readRecords } from "./records.js";
export { connect } from "./transport.js";
