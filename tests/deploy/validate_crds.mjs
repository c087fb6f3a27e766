// Validates prometheus-operator objects against the JSON schemas of
// @kubernetes-models/prometheus-operator (required fields, types, patterns, enums).
// Usage: node validate_crds.mjs <node_modules dir> < objects.json   (a JSON array)
// Prints one line per object and exits 1 when any is invalid.
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

const modules = process.argv[2];
const objects = JSON.parse(readFileSync(0, 'utf8'));
let failed = 0;
for (const obj of objects) {
  const [group, version] = String(obj.apiVersion).split('/');
  const name = `${obj.kind}/${obj.metadata?.name}`;
  if (group !== 'monitoring.coreos.com') {
    console.log(`INVALID ${name}: not a prometheus-operator object (${obj.apiVersion})`);
    failed++;
    continue;
  }
  const file = join(modules, '@kubernetes-models/prometheus-operator', group, version, `${obj.kind}.js`);
  let Model;
  try {
    Model = (await import(pathToFileURL(file).href))[obj.kind];
  } catch (e) {
    console.log(`INVALID ${name}: no model for ${obj.apiVersion} ${obj.kind} (${e.message})`);
    failed++;
    continue;
  }
  try {
    new Model(obj).validate();
    console.log(`valid ${name}`);
  } catch (e) {
    console.log(`INVALID ${name}: ${e.message}`);
    failed++;
  }
}
process.exit(failed ? 1 : 0);
