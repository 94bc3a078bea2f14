// Validate KEDA objects (JSON on stdin: a list) against KEDA's CRD schemas, as generated
// by kubernetes-models; prints one line per object and exits 1 when any is invalid.
import { readFileSync } from "node:fs";
import { ScaledObject, TriggerAuthentication } from "@kubernetes-models/keda/keda.sh/v1alpha1";

const kinds = { ScaledObject, TriggerAuthentication };
const objects = JSON.parse(readFileSync(0, "utf8"));
let bad = 0;
for (const obj of objects) {
  const Kind = kinds[obj.kind];
  const name = `${obj.kind}/${obj.metadata?.name}`;
  if (!Kind) { console.log(`${name}: no schema here`); bad++; continue; }
  try { new Kind(obj).validate(); console.log(`${name}: valid`); }
  catch (err) { console.log(`${name}: INVALID ${err.message}`); bad++; }
}
process.exit(bad ? 1 : 0);
