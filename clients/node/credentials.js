// How the Node clients connect: mutual TLS with the mesh CA and a client certificate, and the
// caller's bearer token on every call, found as every accelmesh process finds them.
//
//   ACCELMESH_CA_FILE, ACCELMESH_CERT_FILE, ACCELMESH_KEY_FILE, ACCELMESH_TOKEN_FILE
//       the mesh CA, the client certificate and key, the token; each one not set comes from
//   ACCELMESH_CREDENTIALS_DIR (default .accelmesh/credentials, from the current directory)
//       the folder `accelmesh up` writes: ca.crt, client.crt, client.key, token.
//   ACCELMESH_INSECURE=1 (or true, yes, on)
//       plaintext without a token, for a mesh started with --insecure.
//
// The client certificate only lets a program connect; the token names the caller (user or
// operator), so jobs are the token's owner's.

"use strict";

const fs = require("fs");
const path = require("path");
const grpc = require("@grpc/grpc-js");

const TRUE = ["1", "true", "yes", "on"];
const FALSE = ["", "0", "false", "no", "off"];
const FILES = [
  ["ACCELMESH_CA_FILE", "ca.crt"],
  ["ACCELMESH_CERT_FILE", "client.crt"],
  ["ACCELMESH_KEY_FILE", "client.key"],
  ["ACCELMESH_TOKEN_FILE", "token"],
];

// A problem with the settings: the scripts print its message as one line and exit 2.
class CredentialsError extends Error {}

function insecure(env) {
  const raw = (env.ACCELMESH_INSECURE || "").toLowerCase();
  if (TRUE.includes(raw)) return true;
  if (FALSE.includes(raw)) return false;
  throw new CredentialsError(`ACCELMESH_INSECURE=${JSON.stringify(env.ACCELMESH_INSECURE)} is not a boolean; set it to 1 or 0`);
}

function readSetting(env, variable, name) {
  const folder = env.ACCELMESH_CREDENTIALS_DIR || path.join(".accelmesh", "credentials");
  const file = env[variable] || path.join(folder, name);
  try {
    return fs.readFileSync(file);
  } catch (err) {
    const from = env[variable] ? `${variable} names ${file}` : `${variable} is not set and ${file} is missing`;
    throw new CredentialsError(
      `${from} (${err.code || err.message}): set ${variable}, or ACCELMESH_CREDENTIALS_DIR to the folder ` +
        "`accelmesh up` made (ACCELMESH_INSECURE=1 for a plaintext mesh)",
    );
  }
}

// grpc-js channel credentials from `env`; throws CredentialsError naming the variable to set.
function channelCredentials(env = process.env) {
  if (insecure(env)) return grpc.credentials.createInsecure();
  const [ca, cert, key, token] = FILES.map(([variable, name]) => readSetting(env, variable, name));
  const bearer = `Bearer ${token.toString("utf8").trim()}`;
  if (bearer === "Bearer ") throw new CredentialsError(`the token file (ACCELMESH_TOKEN_FILE) is empty`);
  const tls = grpc.credentials.createSsl(ca, key, cert);
  const calls = grpc.credentials.createFromMetadataGenerator((_params, callback) => {
    const metadata = new grpc.Metadata();
    metadata.set("authorization", bearer);
    callback(null, metadata);
  });
  return grpc.credentials.combineChannelCredentials(tls, calls);
}

module.exports = { CredentialsError, channelCredentials };
