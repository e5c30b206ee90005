#!/usr/bin/env node
// Runs `mlp_classifier` on the accelmesh dispatch service from Node.js, with nothing but the
// repo's own .proto files, @grpc/grpc-js and @grpc/proto-loader (no generated code).
//
//   node run_job.js <dispatch address> [--rows N] [--filter EXPR] [--timeout SECONDS] [--events]
//
// What it shows a client in any language has to do:
//   1. open one RunJob stream and send the JobSpec first: the program's name and, for each data
//      input, a TensorHeader with its dtype, full shape (rows first) and total byte count;
//   2. send the input rows as InputBlocks of consecutive rows (first_row, then one Tensor per input
//      in spec order: dtype + shape + raw little-endian bytes, row-major);
//   3. read back JobEvents, then each result as a TensorHeader followed by TensorChunks (byte
//      offset + bytes; chunks of different tensors may interleave, each names its tensor), and
//      the finished Job last.
//
// The inputs are deterministic: x[i][j] = ((i*64 + j) % 17) / 17 as float32, so a test can
// compute the same batch and compare the logits with a single-device reference.
// Connects with TLS and the caller's token as credentials.js finds them (ACCELMESH_* variables).
// Prints one JSON line on stdout; exits 1 on any failure (with the reason on stderr), 2 for bad
// arguments or missing credentials.

"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const { CredentialsError, channelCredentials } = require("./credentials");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "protos");
const DISPATCH_PROTO = "accelmesh/dispatch/v1/dispatch_service.proto";
const PROGRAM = "mlp_classifier";
const FEATURES = 64; // mlp_classifier's input: x [N, 64] float32
const CHUNK_BYTES = 1024 * 1024; // input rows per block: as many as fit in 1 MiB (as the Python client)
const MAX_MESSAGE_BYTES = 64 * 1024 * 1024; // above the services' 16 MiB default, so any chunk fits

function usage(message) {
  if (message) process.stderr.write(`run_job.js: ${message}\n`);
  process.stderr.write(
    "usage: node run_job.js <dispatch address> [--rows N] [--filter EXPR] [--timeout SECONDS] [--events]\n",
  );
  process.exit(2);
}

function parseArgs(argv) {
  const options = { address: null, rows: 100, filter: "", timeoutSeconds: 120, events: false };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    const value = () => {
      if (i + 1 >= argv.length) usage(`${arg} needs a value`);
      return argv[++i];
    };
    if (arg === "--rows") options.rows = Number(value());
    else if (arg === "--filter") options.filter = value();
    else if (arg === "--timeout") options.timeoutSeconds = Number(value());
    else if (arg === "--events") options.events = true;
    else if (arg === "-h" || arg === "--help") usage();
    else if (arg.startsWith("-")) usage(`unknown option ${arg}`);
    else if (options.address === null) options.address = arg;
    else usage(`unexpected argument ${arg}`);
  }
  if (!options.address) usage("the dispatch address is required");
  if (!Number.isInteger(options.rows) || options.rows < 1) usage("--rows must be a positive integer");
  if (!(options.timeoutSeconds > 0)) usage("--timeout must be a positive number");
  return options;
}

function loadDispatchService() {
  const definition = protoLoader.loadSync(DISPATCH_PROTO, {
    // The repo's protos; google/protobuf/timestamp.proto comes from the well-known types that
    // proto-loader (protobufjs) bundles, so no extra include directory is needed for it.
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names as in the .proto (job_id, first_row, ...)
    longs: String, // int64 fields arrive as decimal strings: no precision lost
    enums: String, // enum values as their names (JOB_STATE_SUCCEEDED)
    defaults: true,
    oneofs: true, // each oneof also gets a virtual field naming the part that is set
  });
  return grpc.loadPackageDefinition(definition).accelmesh.dispatch.v1.DispatchService;
}

// x[i][j] = ((i*64 + j) % 17) / 17, rounded to float32, row-major little-endian bytes.
function inputBytes(rows) {
  const data = Buffer.alloc(rows * FEATURES * 4);
  for (let k = 0; k < rows * FEATURES; k++) data.writeFloatLE((k % 17) / 17, k * 4);
  return data;
}

function* requests(rows, filter) {
  const data = inputBytes(rows);
  yield {
    spec: {
      program: PROGRAM,
      kind: "JOB_KIND_INFERENCE",
      constraints: { filter },
      inputs: [{ name: "x", dtype: "DATA_TYPE_FLOAT32", shape: [rows, FEATURES], total_bytes: data.length }],
      parameter_seed: 0, // the program's initial parameters for seed 0
      name: "node-client",
    },
  };
  const rowBytes = FEATURES * 4;
  const step = Math.max(1, Math.floor(CHUNK_BYTES / rowBytes));
  for (let first = 0; first < rows; first += step) {
    const count = Math.min(step, rows - first);
    yield {
      block: {
        first_row: first,
        tensors: [
          {
            dtype: "DATA_TYPE_FLOAT32",
            shape: [count, FEATURES],
            data: data.subarray(first * rowBytes, (first + count) * rowBytes),
          },
        ],
      },
    };
  }
}

// Result tensors: a header announces each, chunks fill its bytes at their offsets.
class Results {
  constructor() {
    this.tensors = new Map();
  }

  header(header) {
    const totalBytes = Number(header.total_bytes);
    this.tensors.set(header.name, {
      dtype: header.dtype,
      shape: header.shape.map(Number),
      data: Buffer.alloc(totalBytes),
      received: 0,
    });
  }

  chunk(chunk) {
    const tensor = this.tensors.get(chunk.name);
    if (!tensor) throw new Error(`chunk of ${chunk.name} before its header`);
    const offset = Number(chunk.offset);
    if (offset !== tensor.received) throw new Error(`chunk of ${chunk.name} at ${offset}, expected ${tensor.received}`);
    if (offset + chunk.data.length > tensor.data.length) throw new Error(`chunk of ${chunk.name} past its end`);
    chunk.data.copy(tensor.data, offset);
    tensor.received += chunk.data.length;
  }

  // A float32 tensor as nested arrays of numbers (every float32 is exact as a JS number).
  float32(name) {
    const tensor = this.tensors.get(name);
    if (!tensor) throw new Error(`no result named ${name}`);
    if (tensor.dtype !== "DATA_TYPE_FLOAT32") throw new Error(`${name} is ${tensor.dtype}, not float32`);
    if (tensor.received !== tensor.data.length) {
      throw new Error(`${name}: ${tensor.received} of ${tensor.data.length} bytes received`);
    }
    const build = (dims, offset) => {
      if (dims.length === 0) return tensor.data.readFloatLE(offset * 4);
      const [n, ...rest] = dims;
      const stride = rest.reduce((a, b) => a * b, 1);
      return Array.from({ length: n }, (_, i) => build(rest, offset + i * stride));
    };
    return { shape: tensor.shape, values: build(tensor.shape, 0) };
  }
}

function runJob(client, options) {
  return new Promise((resolve, reject) => {
    const deadline = new Date(Date.now() + options.timeoutSeconds * 1000);
    const call = client.RunJob({ deadline });
    const results = new Results();
    let job = null;

    call.on("data", (response) => {
      try {
        switch (response.part) {
          case "event":
            if (options.events) {
              const e = response.event;
              process.stderr.write(`event ${e.index} ${e.type} ${e.message}\n`);
            }
            break;
          case "tensor":
            results.header(response.tensor);
            break;
          case "chunk":
            results.chunk(response.chunk);
            break;
          case "job":
            job = response.job;
            break;
          default:
            break; // a part a newer server added: ignore it
        }
      } catch (err) {
        call.cancel();
        reject(err);
      }
    });
    call.on("error", reject);
    call.on("end", () => resolve({ job, results }));

    // Write the request stream, waiting for 'drain' whenever the stream buffers too much.
    const parts = requests(options.rows, options.filter);
    const pump = () => {
      for (let next = parts.next(); !next.done; next = parts.next()) {
        if (!call.write(next.value)) {
          call.once("drain", pump);
          return;
        }
      }
      call.end();
    };
    pump();
  });
}

async function main() {
  const options = parseArgs(process.argv.slice(2));
  const DispatchService = loadDispatchService();
  const client = new DispatchService(options.address, channelCredentials(), {
    "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
    "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
  });
  try {
    const { job, results } = await runJob(client, options);
    if (!job) throw new Error("the stream ended without the finished job");
    if (job.state !== "JOB_STATE_SUCCEEDED") {
      throw new Error(`job ${job.job_id} ended ${job.state}: ${job.error || "(no error given)"}`);
    }
    const logits = results.float32("logits");
    const plan = job.plan || { targets: [] };
    const line = {
      job_id: job.job_id,
      state: job.state,
      device_ids: job.shards.map((s) => s.device_id),
      shards: job.shards.map((s) => ({
        index: s.index,
        device_id: s.device_id,
        target_type: s.target_type,
        rule: s.rule,
        first_row: Number(s.first_row),
        rows: Number(s.rows),
        attempts: s.attempts,
      })),
      targets: plan.targets.map((t) => ({
        target_type: t.target_type,
        rule: t.rule,
        compute_dtype: t.compute_dtype,
        device_ids: t.device_ids,
      })),
      logits_shape: logits.shape,
      logits: logits.values,
    };
    process.stdout.write(JSON.stringify(line) + "\n");
  } finally {
    client.close();
  }
}

main().catch((err) => {
  // gRPC errors' messages already start with the status ("14 UNAVAILABLE: ...").
  process.stderr.write(`run_job.js: ${err && err.message ? err.message : err}\n`);
  process.exit(err instanceof CredentialsError ? 2 : 1);
});
