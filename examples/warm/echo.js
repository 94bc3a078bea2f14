#!/usr/bin/env node
// A warm tool (PROCESS=warm, docs/child-process.md "Warm mode"): one request line per
// job on stdin, one response line per job on stdout.
const lines = require("readline").createInterface({ input: process.stdin });
lines.on("line", (line) => {
  const request = JSON.parse(line);
  process.stdout.write(JSON.stringify({ echo: request.payload, job: request.job_id }) + "\n");
});
