// Validate Prometheus Operator resources against the operator's schemas, offline.
// Reads a JSON array of manifests on stdin; prints one JSON line per manifest:
// {"kind", "name", "errors": [...]}. Exit status 0 even when a manifest is invalid (the
// caller asserts on the lines), 2 when a kind is unknown here.
import * as operator from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1";

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const manifests = JSON.parse(Buffer.concat(chunks).toString("utf8"));

let unknown = false;
for (const manifest of manifests) {
  const Model = manifest.apiVersion === "monitoring.coreos.com/v1" ? operator[manifest.kind] : undefined;
  const name = manifest.metadata?.name;
  if (Model === undefined) {
    console.log(JSON.stringify({ kind: manifest.kind, name, errors: ["unknown kind"] }));
    unknown = true;
    continue;
  }
  let errors = [];
  try {
    new Model(manifest).validate();
  } catch (error) {
    errors = [String(error.message ?? error)];
  }
  console.log(JSON.stringify({ kind: manifest.kind, name, errors }));
}
process.exit(unknown ? 2 : 0);
