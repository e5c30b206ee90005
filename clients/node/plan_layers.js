#!/usr/bin/env node
// Plans a model of the client's own on the accelmesh dispatch service from Node.js: sends a layer
// table (DispatchService.PlanJob with spec.placement.layers) and prints where each layer would run,
// with nothing but the repo's own .proto files, @grpc/grpc-js and @grpc/proto-loader.
//
//   node plan_layers.js <dispatch address> [--layers FILE.json] [--strategy ranked|balanced|auto]
//                       [--device-count N] [--micro-batch-rows N] [--explain]
//
// FILE.json is a JSON array of LayerCost rows (or an object whose "layers" is one), with the
// .proto field names: {"name", "order", "parameter_count", "parameter_bytes", "flops_per_sample",
// "bytes_accessed_per_sample", "activation_bytes_per_sample", "shared_from",
// "shared_parameter_bytes"}. int64 fields are JSON integers (exact up to 2^53) or decimal strings.
// The dispatcher checks the table and names the row and field of anything wrong.
//
// Without --layers it plans a built-in decoder-only transformer (GPT-2 small's shape with a
// 32k vocabulary, float32 weights, one sample = one sequence of SEQ_TOKENS tokens):
//   embed      token table VOCAB x D_MODEL + learned positions SEQ_TOKENS x D_MODEL;
//   block_0..  N_BLOCKS pre-norm blocks: attention (q, k, v, out: 4 D_MODEL^2 + 4 D_MODEL),
//              MLP (D_MODEL x D_FF, D_FF x D_MODEL, biases), two LayerNorms (4 D_MODEL);
//              FLOPs/sample = 2 x SEQ_TOKENS x matmul parameters + 4 x SEQ_TOKENS^2 x D_MODEL
//              (QK^T and attention x V, causal mask not exploited);
//   head       final LayerNorm + the LM head, tied to embed's token table (shared_from "embed"),
//              FLOPs/sample = 2 x SEQ_TOKENS x D_MODEL x VOCAB, output = the logits.
// bytes_accessed_per_sample counts unfused traffic (parameters once, every intermediate written
// and read), like XLA's cost analysis. About 110 M parameters, 440 MB.
//
// Prints one JSON line on stdout (the placement summary). --explain also prints the planner's
// explanation on stderr, one step per line. On a gRPC error prints "<STATUS NAME>: <details>" on
// stderr and exits 1; exits 2 for bad arguments or missing credentials. Connects with TLS and the
// caller's token as credentials.js finds them (ACCELMESH_* variables).

"use strict";

const fs = require("fs");
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const { CredentialsError, channelCredentials } = require("./credentials");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "protos");
const DISPATCH_PROTO = "accelmesh/dispatch/v1/dispatch_service.proto";
const DEADLINE_S = 60; // planning reads the inventory and scores devices: seconds at most

// The built-in decoder.
const VOCAB = 32000;
const D_MODEL = 768;
const HEADS = 12;
const D_FF = 4 * D_MODEL;
const N_BLOCKS = 12;
const SEQ_TOKENS = 512;
const FLOAT_BYTES = 4; // float32 weights and activations

const STRATEGIES = { ranked: "PLACEMENT_STRATEGY_RANKED", balanced: "PLACEMENT_STRATEGY_BALANCED",
  auto: "PLACEMENT_STRATEGY_AUTO" };
const LAYER_FIELDS = new Set(["name", "order", "parameter_count", "parameter_bytes", "flops_per_sample",
  "bytes_accessed_per_sample", "activation_bytes_per_sample", "shared_from", "shared_parameter_bytes"]);
const INT64_FIELDS = new Set(["parameter_count", "parameter_bytes", "activation_bytes_per_sample",
  "shared_parameter_bytes"]);

function usage(message) {
  if (message) process.stderr.write(`plan_layers.js: ${message}\n`);
  process.stderr.write(
    "usage: node plan_layers.js <dispatch address> [--layers FILE.json] [--strategy ranked|balanced|auto]\n" +
    "                           [--device-count N] [--micro-batch-rows N] [--explain]\n",
  );
  process.exit(2);
}

function parseArgs(argv) {
  const options = { address: null, layersFile: null, strategy: "auto", deviceCount: 0, microBatchRows: 0,
    explain: false };
  const count = (arg, text, min) => {
    const n = Number(text);
    if (!Number.isInteger(n) || n < min) usage(`${arg} must be an integer >= ${min}, got ${text}`);
    return n;
  };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    const value = () => {
      if (i + 1 >= argv.length) usage(`${arg} needs a value`);
      return argv[++i];
    };
    if (arg === "--layers") options.layersFile = value();
    else if (arg === "--strategy") options.strategy = value();
    else if (arg === "--device-count") options.deviceCount = count(arg, value(), 0); // 0: derived from memory
    else if (arg === "--micro-batch-rows") options.microBatchRows = count(arg, value(), 1);
    else if (arg === "--explain") options.explain = true;
    else if (arg === "-h" || arg === "--help") usage();
    else if (arg.startsWith("-")) usage(`unknown option ${arg}`);
    else if (options.address === null) options.address = arg;
    else usage(`unexpected argument ${arg}`);
  }
  if (!options.address) usage("the dispatch address is required");
  if (!(options.strategy in STRATEGIES)) usage(`--strategy must be ranked, balanced or auto, got ${options.strategy}`);
  return options;
}

function decoderLayers() {
  const act = SEQ_TOKENS * D_MODEL * FLOAT_BYTES; // one sample's hidden states
  const embedParams = (VOCAB + SEQ_TOKENS) * D_MODEL;
  const matmulParams = 4 * D_MODEL * D_MODEL + 2 * D_MODEL * D_FF;
  const blockParams = matmulParams + 4 * D_MODEL + D_FF + D_MODEL + 4 * D_MODEL; // + biases + 2 LayerNorms
  const blockTraffic = FLOAT_BYTES * SEQ_TOKENS * (
    D_MODEL + 2 * 3 * D_MODEL + 2 * HEADS * SEQ_TOKENS + 2 * D_MODEL + 2 * D_FF + D_MODEL);
  const layers = [{
    name: "embed", order: 0, parameter_count: embedParams, parameter_bytes: embedParams * FLOAT_BYTES,
    flops_per_sample: SEQ_TOKENS * D_MODEL, // adding the positions
    bytes_accessed_per_sample: 3 * act, activation_bytes_per_sample: act,
  }];
  for (let b = 0; b < N_BLOCKS; b++) {
    layers.push({
      name: `block_${b}`, order: 1 + b, parameter_count: blockParams, parameter_bytes: blockParams * FLOAT_BYTES,
      flops_per_sample: 2 * SEQ_TOKENS * matmulParams + 4 * SEQ_TOKENS * SEQ_TOKENS * D_MODEL,
      bytes_accessed_per_sample: blockParams * FLOAT_BYTES + blockTraffic, activation_bytes_per_sample: act,
    });
  }
  const logits = SEQ_TOKENS * VOCAB * FLOAT_BYTES;
  const tied = VOCAB * D_MODEL * FLOAT_BYTES;
  layers.push({
    name: "head", order: 1 + N_BLOCKS, parameter_count: 2 * D_MODEL, parameter_bytes: 2 * D_MODEL * FLOAT_BYTES,
    flops_per_sample: 2 * SEQ_TOKENS * D_MODEL * VOCAB, bytes_accessed_per_sample: tied + act + logits,
    activation_bytes_per_sample: logits, shared_from: "embed", shared_parameter_bytes: tied,
  });
  return layers;
}

// Reads FILE.json; refuses what the proto cannot carry exactly (unknown fields, which protobufjs
// would drop silently, and int64 numbers JSON already rounded). Values are the server's to judge.
function readLayers(file) {
  let table;
  try {
    table = JSON.parse(fs.readFileSync(file, "utf8"));
  } catch (err) {
    usage(`--layers ${file}: ${err.message}`);
  }
  const rows = Array.isArray(table) ? table : table && table.layers;
  if (!Array.isArray(rows)) usage(`--layers ${file}: expected a JSON array of layer rows or {"layers": [...]}`);
  rows.forEach((row, i) => {
    if (row === null || typeof row !== "object" || Array.isArray(row)) usage(`--layers ${file}: row ${i} is not an object`);
    for (const [key, value] of Object.entries(row)) {
      if (!LAYER_FIELDS.has(key)) {
        usage(`--layers ${file}: row ${i} has unknown field ${key}; LayerCost fields are ${[...LAYER_FIELDS].join(", ")}`);
      }
      if (INT64_FIELDS.has(key) && typeof value === "number" && !Number.isSafeInteger(value)) {
        usage(`--layers ${file}: row ${i} ${key} ${value} is not an integer below 2^53; give it as a decimal string`);
      }
    }
  });
  return rows;
}

function loadDispatchService() {
  const definition = protoLoader.loadSync(DISPATCH_PROTO, {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names as in the .proto (parameter_bytes, device_id, ...)
    longs: String, // int64 fields arrive as decimal strings: no precision lost
    enums: String, // enum values as their names (PLACEMENT_STRATEGY_BALANCED)
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).accelmesh.dispatch.v1.DispatchService;
}

// An int64 that arrived as a decimal string, as a JSON number when that is exact (below 2^53,
// 8 PiB: every byte count a device has), else kept as the string.
function int64(text) {
  const n = Number(text);
  return Number.isSafeInteger(n) ? n : text;
}

function planJob(client, request) {
  return new Promise((resolve, reject) => {
    client.PlanJob(request, { deadline: new Date(Date.now() + DEADLINE_S * 1000) }, (err, response) =>
      (err ? reject(err) : resolve(response)));
  });
}

function summarize(label, layers, placement) {
  const load = (d) => ({
    device_id: d.device_id,
    target_type: d.target_type,
    memory_bytes: int64(d.memory_bytes),
    memory_capacity_bytes: int64(d.memory_capacity_bytes),
    compute_seconds: d.compute_seconds,
    transfer_seconds: d.transfer_seconds,
    layers: d.layers,
  });
  return {
    model: label,
    parameter_count: layers.reduce((sum, x) => sum + Number(x.parameter_count || 0), 0),
    strategy: placement.strategy,
    device_count: placement.device_count,
    micro_batch_rows: int64(placement.micro_batch_rows),
    layers: placement.layers.map((x) => ({
      layer: x.layer, order: x.order, device_id: x.device_id, stage: x.stage,
      memory_bytes: int64(x.memory_bytes), compute_seconds: x.compute_seconds,
    })),
    stages: placement.stages.map((s) => ({
      index: s.index, device_id: s.device_id, rule: s.rule, first_layer: s.first_layer, layer_count: s.layer_count,
      compute_seconds: s.compute_seconds, transfer_seconds: s.transfer_seconds,
      replica_device_ids: s.replica_device_ids, micro_batch_shares: s.micro_batch_shares,
    })),
    devices: placement.devices.map(load),
    predicted_step_seconds: placement.predicted_step_seconds,
    lower_bound_step_seconds: placement.lower_bound_step_seconds,
    lower_bound_offered_step_seconds: placement.lower_bound_offered_step_seconds,
    cross_device_transfers: placement.cross_device_transfers,
    weights: placement.weights, // null when the server sent none
    weights_rule: placement.weights_rule,
    candidates: placement.candidates.map((c) => ({
      strategy: c.strategy, feasible: c.feasible, predicted_step_seconds: c.predicted_step_seconds,
      cross_device_transfers: c.cross_device_transfers, device_count: c.device_count, error: c.error,
    })),
  };
}

async function main() {
  const options = parseArgs(process.argv.slice(2));
  const layers = options.layersFile ? readLayers(options.layersFile) : decoderLayers();
  const label = options.layersFile ? path.basename(options.layersFile, ".json") : `decoder-${N_BLOCKS}l-${D_MODEL}d`;
  const DispatchService = loadDispatchService();
  const client = new DispatchService(options.address, channelCredentials());
  try {
    const response = await planJob(client, {
      spec: {
        program: label, // with an explicit table the program is only a label, and inputs may be empty
        kind: "JOB_KIND_INFERENCE",
        name: "node-plan-layers",
        placement: {
          strategy: STRATEGIES[options.strategy],
          device_count: options.deviceCount,
          micro_batch_rows: options.microBatchRows, // 0: the server's default
          layers,
        },
      },
    });
    const placement = response.plan && response.plan.placement;
    if (!placement) throw new Error("the plan has no placement: is the dispatcher older than PlanJob's spec.placement?");
    if (options.explain) for (const line of placement.explain) process.stderr.write(`${line}\n`);
    process.stdout.write(JSON.stringify(summarize(label, layers, placement)) + "\n");
  } finally {
    client.close();
  }
}

main().catch((err) => {
  // A gRPC error carries its status code and the server's details ("which row, which field").
  const text = err && typeof err.code === "number" && err.details !== undefined
    ? `${grpc.status[err.code]}: ${err.details}`
    : (err && err.message) || String(err);
  process.stderr.write(`plan_layers.js: ${text}\n`);
  process.exit(err instanceof CredentialsError ? 2 : 1);
});
