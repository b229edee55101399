-- nebula's state.db as commit 1b4814b wrote it: a Slurm cluster's two nodes (their notes under
-- detail["slurm"], as control/jobs.py wrote them) and its login node's relay
BEGIN TRANSACTION;
CREATE TABLE clusters (
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        name TEXT NOT NULL,
        transport TEXT NOT NULL,
        gateway TEXT,
        PRIMARY KEY (job_id, name)
    );
INSERT INTO "clusters" VALUES('demo-20261202-074438-7cec','hpc','ssh',NULL);
CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        ts REAL NOT NULL,
        cluster TEXT,
        host TEXT,
        kind TEXT NOT NULL,
        message TEXT NOT NULL
    );
CREATE TABLE hosts (
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        cluster TEXT NOT NULL,
        host TEXT NOT NULL,
        role TEXT NOT NULL,
        node_rank INTEGER NOT NULL,
        slots INTEGER NOT NULL,
        agent_dir TEXT NOT NULL,
        state TEXT NOT NULL,
        pid INTEGER,
        pgid INTEGER,
        exit_code INTEGER,
        restarts INTEGER NOT NULL DEFAULT 0,
        updated REAL NOT NULL,
        detail TEXT,
        PRIMARY KEY (job_id, cluster, host, role)
    );
INSERT INTO "hosts" VALUES('demo-20261202-074438-7cec','hpc','n1','worker',0,1,'/x','RUNNING',100,NULL,NULL,0,1.79619747809524798391e+09,'{"conn": {"transport": "slurm-node", "name": "n1", "login": {"transport": "ssh", "name": "login", "host": "login", "user": "jdoe", "port": 2222, "key": null, "jump": null, "python": "python3"}, "job": "12", "node": "n1", "address": "10.1.0.1", "keeper": "12", "python": "python3", "pythonpath": "/home/jdoe/.nebula/jobs/j/lib"}, "slurm": "Slurm job 12 RUNNING on n[1-2]"}');
INSERT INTO "hosts" VALUES('demo-20261202-074438-7cec','hpc','n2','worker',1,1,'/x','RUNNING',101,NULL,NULL,0,1.79619747810679817202e+09,'{"conn": {"transport": "slurm-node", "name": "n2", "login": {"transport": "ssh", "name": "login", "host": "login", "user": "jdoe", "port": 2222, "key": null, "jump": null, "python": "python3"}, "job": "12", "node": "n2", "address": "10.1.0.2", "keeper": "12", "python": "python3", "pythonpath": "/home/jdoe/.nebula/jobs/j/lib"}, "slurm": "Slurm job 12 RUNNING on n[1-2]"}');
INSERT INTO "hosts" VALUES('demo-20261202-074438-7cec','hpc','login','relay',0,1,'/y','RUNNING',NULL,NULL,NULL,0,1.7961974781232092381e+09,'{"conn": {"transport": "ssh", "name": "login", "host": "login", "user": "jdoe", "port": 2222, "key": null, "jump": null, "python": "python3"}}');
CREATE TABLE jobs (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        spec_path TEXT,
        spec_json TEXT NOT NULL,
        state TEXT NOT NULL,
        created REAL NOT NULL,
        started REAL,
        ended REAL,
        reason TEXT
    );
INSERT INTO "jobs" VALUES('demo-20261202-074438-7cec','demo',NULL,'{"name": "demo", "clusters": [{"name": "hpc", "hosts": [{"host": "login"}], "scheduler": "slurm"}]}','RUNNING',1.79619747807210803029e+09,1.79619747808421754836e+09,NULL,NULL);
CREATE INDEX events_job ON events(job_id, id);
DELETE FROM "sqlite_sequence";
COMMIT;
PRAGMA user_version = 1;
