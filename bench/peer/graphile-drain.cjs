// The bench's drain of graphile-worker, its nearest peer among Postgres job queues, run
// as that project documents it: `setup` installs its schema and enqueues JOBS no-op jobs;
// `work` runs one worker process with CONCURRENCY slots and a connection more than that
// in its pool (its default pool, of as many connections as slots, keeps one for LISTEN,
// which leaves a slot waiting for a connection), its defaults otherwise, until SIGTERM;
// then prints how many jobs it ran and how many it ran twice, as one JSON line.
// The bench holds the jobs table locked while the processes start, so that every slot's
// first claim waits for the same moment, and dates the end by the table being empty.
"use strict";
const { run, runMigrations, makeWorkerUtils } = require("graphile-worker");

const connectionString = process.env.DATABASE_URL;
const logger = new (require("@graphile/logger").Logger)(() => (level, message) => {
  if (level === "error" || level === "warning") console.error(`graphile-worker ${level}: ${message}`);
});

async function setup() {
  const jobs = Number(process.env.JOBS);
  await runMigrations({ connectionString, logger });
  const utils = await makeWorkerUtils({ connectionString, logger });
  try {
    for (let done = 0; done < jobs; done += 1000) {
      const n = Math.min(1000, jobs - done);
      await utils.addJobs(Array.from({ length: n }, (_, i) => ({ identifier: "bench", payload: { n: done + i } })));
    }
  } finally {
    await utils.release();
  }
}

async function work() {
  const seen = new Set();
  let twice = 0;
  const concurrency = Number(process.env.CONCURRENCY);
  const runner = await run({
    connectionString,
    concurrency,
    maxPoolSize: concurrency + 1,
    noHandleSignals: true,
    logger,
    taskList: {
      bench: async (payload) => {
        if (seen.has(payload.n)) twice += 1;
        seen.add(payload.n);
      },
    },
  });
  process.once("SIGTERM", async () => {
    await runner.stop();
    process.stdout.write(`${JSON.stringify({ ran: seen.size + twice, twice })}\n`);
    process.exit(0);
  });
  await runner.promise;
}

({ setup, work })[process.argv[2]]().catch((e) => {
  console.error(e);
  process.exit(1);
});
