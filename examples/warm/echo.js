#!/usr/bin/env node
// A warm tool (PROCESS=warm, docs/child-process.md "Warm mode"): one request line per
// job on stdin, one response line per job on stdout, naming the job it answers.
const lines = require("readline").createInterface({ input: process.stdin });
lines.on("line", (line) => {
  const request = JSON.parse(line);
  const answer = { job_id: request.job_id, result: { echo: request.payload } };
  process.stdout.write(JSON.stringify(answer) + "\n");
});
