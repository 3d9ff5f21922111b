/*
 * One tick of one job, fired by three replicas that share a lock server and
 * its tick store. See README.md beside this file for what is modelled, what
 * is abstracted and what each check proves; `bash scheduler/model/check`
 * checks every variant.
 *
 * Variants (spin -D...):
 *   TODAY                the protocol scheduler/src/{per_tick,run}.rs ran before
 *                        the start record (kept to show what it allowed):
 *                        lock -> read the completed mark -> handler -> write
 *                        the mark (unconditionally) -> retain the lock
 *   FENCED               the fenced start record the scheduler runs, with one of
 *     AT_MOST_ONCE       a Started tick is never started again (Abandoned)
 *     AT_LEAST_ONCE      a Started tick whose lock expired is taken over
 *   and, with FENCED, the broken writes the checker must catch:
 *     BROKEN_START       the Started write (and the takeover) unconditional
 *     BROKEN_COMPLETE    the Completed write not conditional on the token
 *   STARTS               with TODAY: check instead that no handler is called
 *                        after its lock lapsed and another replica ran the
 *                        tick (rather than that none runs to completion twice)
 *   WITNESS              with FENCED: fail on reaching the outcome the mode
 *                        exists for (a takeover or an abandon, and a late
 *                        Completed fenced out), to show it is reachable
 */

#define N 3             /* replicas */

/* The tick's record in the tick store. */
#define NONE      0
#define STARTED   1
#define COMPLETED 2
#define ABANDONED 3

/* The tick's lock on the lock server. */
byte lock_owner = 0;    /* 0: free; else the holder's id + 1 */
byte lock_tok = 0;      /* the holder's fencing token */
bool retained = false;  /* TODAY: kept past every replica's firing */
byte next_tok = 0;      /* the server's fencing counter: +1 per acquire */
byte tok_owner[N + 1];  /* which replica got each token */

/* The tick store. */
byte rec = NONE;        /* FENCED: the tick's record ... */
byte rec_tok = 0;       /* ... and the token it was last written under */
bool mark = false;      /* TODAY: the completed mark */

/* What happened, for the assertions. */
byte calls = 0;         /* handler calls */
byte returned = 0;      /* handler calls that returned (not aborted) */
byte completions = 0;   /* transitions into Completed on the server */
byte max_started = 0;   /* highest token a Started write stored */
byte fenced_out = 0;    /* Completed writes refused */
byte finished = 0;      /* replicas done with the tick, whatever the outcome */
bool gone[N];        /* crashed, or gave up after a lost reply */

/* A crash (or a stop: the process is gone for good) may come before any step. */
#define CRASHPOINT \
	if \
	:: skip \
	:: gone[id] = true; printf("MSC: replica %d crashes\n", id); goto out \
	fi

/* A write's reply may be lost after the server applied it. The replica then
 * retries the same write (same token) or gives up, which for the checks is a
 * stop like a crash (it runs nothing more). */
#define REPLY_LOST_RETRY_OR_STOP(write) \
	if \
	:: skip \
	:: printf("MSC: replica %d: reply lost\n", id); \
	   if \
	   :: write \
	   :: gone[id] = true; printf("MSC: replica %d gives up\n", id); goto out \
	   fi \
	fi

#define HOLDS (lock_owner == id + 1 && lock_tok == tok)

#ifdef FENCED
/* One server-side step each, conditional on the token. `won` is the answer. */

/* absent -> Started{tok}; a retry of the same write is a no-op that wins */
#ifdef BROKEN_START
#define START_WRITE \
	atomic { \
		rec = STARTED; rec_tok = tok; won = true; \
		if :: tok > max_started -> max_started = tok :: else fi; \
		printf("MSC: replica %d: Started{%d} written (unconditionally)\n", id, tok) \
	}
#else
#define START_WRITE \
	atomic { \
		if \
		:: rec == NONE -> rec = STARTED; rec_tok = tok; won = true; \
		   if :: tok > max_started -> max_started = tok :: else fi; \
		   printf("MSC: replica %d: Started{%d} written\n", id, tok) \
		:: rec == STARTED && rec_tok == tok -> won = true; \
		   printf("MSC: replica %d: Started{%d} already there (a retry)\n", id, tok) \
		:: else -> won = false; \
		   printf("MSC: replica %d: Started{%d} refused\n", id, tok) \
		fi \
	}
#endif

/* Started{lower} -> Started{tok}: AT_LEAST_ONCE's takeover of a tick whose
 * runner's lock expired (this replica holds the lock now, with a higher
 * token). */
#ifdef BROKEN_START
#define TAKEOVER_WRITE START_WRITE
#else
#define TAKEOVER_WRITE \
	atomic { \
		if \
		:: rec == STARTED && rec_tok < tok -> rec_tok = tok; won = true; \
		   if :: tok > max_started -> max_started = tok :: else fi; \
		   printf("MSC: replica %d: takes over: Started{%d} written\n", id, tok) \
		:: rec == STARTED && rec_tok == tok -> won = true; \
		   printf("MSC: replica %d: Started{%d} already there (a retry)\n", id, tok) \
		:: else -> won = false; \
		   printf("MSC: replica %d: takeover Started{%d} refused\n", id, tok) \
		fi \
	}
#endif

/* Started{lower} -> Abandoned: AT_MOST_ONCE's verdict on a tick whose
 * runner's lock expired. */
#define ABANDON_WRITE \
	atomic { \
		if \
		:: rec == STARTED && rec_tok < tok -> rec = ABANDONED; rec_tok = tok; \
		   printf("MSC: replica %d: marks the tick Abandoned\n", id) \
		:: else -> \
		   printf("MSC: replica %d: Abandoned refused (record state %d)\n", id, rec) \
		fi \
	}

/* Started{tok} -> Completed{tok}; a retry onto Completed{tok} is a no-op. */
#ifdef BROKEN_COMPLETE
#define COMPLETE_WRITE \
	atomic { \
		if \
		:: rec == COMPLETED && rec_tok == tok \
		:: else -> \
		   printf("MSC: replica %d: Completed{%d} written (unconditionally)\n", id, tok); \
		   assert(completions == 0); \
		   assert(tok == max_started); \
		   rec = COMPLETED; rec_tok = tok; completions++ \
		fi \
	}
#else
#define COMPLETE_WRITE \
	atomic { \
		if \
		:: rec == STARTED && rec_tok == tok -> \
		   printf("MSC: replica %d: Completed{%d} written\n", id, tok); \
		   assert(completions == 0); \
		   assert(tok == max_started); \
		   rec = COMPLETED; completions++ \
		:: rec == COMPLETED && rec_tok == tok \
		:: else -> fenced_out++; \
		   printf("MSC: replica %d: Completed{%d} refused (fenced out)\n", id, tok) \
		fi \
	}
#endif
#endif /* FENCED */

proctype replica(byte id) {
	byte tok = 0;
#ifdef FENCED
	byte seen;
	bool won = false;
#endif

	/* Fires the tick (replicas' clocks are within the tolerance: all of
	 * them fire it, in any order) and tries its lock. */
	CRASHPOINT;
	atomic {
		if
		:: lock_owner == 0 ->
			next_tok++; tok = next_tok; tok_owner[tok] = id;
			lock_owner = id + 1; lock_tok = tok;
			printf("MSC: replica %d takes the lock, token %d\n", id, tok)
		:: else ->
			printf("MSC: replica %d finds the lock held; skips\n", id);
			goto out
		fi
	}
	/* An acquire whose reply is lost fails closed: not run; the lock
	 * lapses on its own. */
	if
	:: skip
	:: printf("MSC: replica %d: lock reply lost; skips\n", id); goto out
	fi;

#ifdef TODAY
	CRASHPOINT;
	if
	:: mark -> printf("MSC: replica %d finds the mark; skips\n", id); goto release
	:: else -> printf("MSC: replica %d finds no mark\n", id)
	fi;
	CRASHPOINT;
	atomic {
		printf("MSC: replica %d calls the handler\n", id);
#ifdef STARTS
		/* no handler is called, even to be aborted at once, once its
		 * lock has lapsed and another replica ran the tick */
		assert(HOLDS || returned == 0);
#endif
		calls++
	}
	CRASHPOINT;
	/* The handler returns, or is aborted when the lock is found lost. A
	 * replica frozen across its deadline whose handler result is ready at
	 * the thaw returns too (run.rs's biased select); the model reaches
	 * that state as "returned, then the lock expired". */
	atomic {
		if
		:: HOLDS ->
			printf("MSC: replica %d: handler returned\n", id);
#ifndef STARTS
			/* today's promise: a tick runs to completion once */
			assert(returned == 0);
#endif
			returned++
		:: else -> printf("MSC: replica %d: lock lost; handler aborted\n", id); goto release
		fi
	}
	CRASHPOINT;
	/* record_completed: unconditional. Its reply being lost changes
	 * nothing here but how long the lock is kept. */
	atomic { mark = true; printf("MSC: replica %d writes the mark\n", id) }
	CRASHPOINT;
	/* verify, then retain_for(tick + tolerance): every replica fires the
	 * tick before it runs out. A lock already lost is released. */
	atomic {
		if
		:: HOLDS -> retained = true; printf("MSC: replica %d retains the lock\n", id)
		:: else -> printf("MSC: replica %d: lock found lost\n", id)
		fi
	}
	goto out;
#endif

#ifdef FENCED
	CRASHPOINT;
	atomic { seen = rec; printf("MSC: replica %d reads the record: state %d, token %d\n", id, rec, rec_tok) }
	CRASHPOINT;
	if
	:: seen == NONE ->
		START_WRITE;
		REPLY_LOST_RETRY_OR_STOP(START_WRITE)
	:: seen == STARTED ->
		/* This replica holds the lock with a higher token than the
		 * record's: the runner's lock has expired. */
#ifdef AT_MOST_ONCE
		ABANDON_WRITE;
		REPLY_LOST_RETRY_OR_STOP(ABANDON_WRITE);
		goto release
#else
		TAKEOVER_WRITE;
		REPLY_LOST_RETRY_OR_STOP(TAKEOVER_WRITE)
#endif
	:: else -> printf("MSC: replica %d: tick done or abandoned; skips\n", id); goto release
	fi;
	if
	:: won
	:: else -> goto release
	fi;
	CRASHPOINT;
	atomic {
		printf("MSC: replica %d calls the handler, token %d\n", id, tok);
#ifdef AT_MOST_ONCE
		assert(calls == 0);    /* no tick is started twice */
#endif
		calls++
	}
	/* A runner whose lock expires (it is paused) carries on to its
	 * Completed write: the worst case for the fencing. */
	CRASHPOINT;
	atomic { returned++; printf("MSC: replica %d: handler returned\n", id) }
	CRASHPOINT;
	COMPLETE_WRITE;
	REPLY_LOST_RETRY_OR_STOP(COMPLETE_WRITE);
#endif

release:
	CRASHPOINT;
	atomic {
		if
		:: HOLDS -> lock_owner = 0; printf("MSC: replica %d releases the lock\n", id)
		:: else
		fi
	}
out:
	finished++
}

/* The lock's TTL runs out while its holder is paused (or dead). A pause may
 * be of any length and come at any step, so expiry is possible whenever the
 * lock is held, except a TODAY lock retained past every replica's firing. */
active proctype expiry() {
	do
	:: atomic { lock_owner != 0 && !retained ->
		printf("MSC: the lock (token %d) expires\n", lock_tok);
		lock_owner = 0 }
	:: finished == N -> break
	od
}

init {
	atomic {
		run replica(0);
		run replica(1);
		run replica(2)
	}
	finished == N;
	printf("MSC: end: handler calls %d, returned %d, record state %d token %d, completions %d, fenced out %d\n",
		calls, returned, rec, rec_tok, completions, fenced_out);
#ifdef FENCED
	assert(completions <= 1);
	/* A tick whose (last) runner kept running ends Completed (or, at most
	 * once, Abandoned): a Started record is left only by a runner that
	 * crashed or gave up. */
	assert(rec != STARTED || gone[tok_owner[rec_tok]]);
#ifdef AT_LEAST_ONCE
	/* Exactly one Completed, with the highest token. */
	assert(rec != COMPLETED || (completions == 1 && rec_tok == max_started));
#endif
#ifdef WITNESS
	/* Not a property: fails when the run reaches the outcome the mode
	 * exists for, so the check shows it is reachable (the model is not
	 * vacuous): the tick taken over and completed by the second runner
	 * (at least once) or abandoned (at most once), and the first runner's
	 * late Completed fenced out. */
#ifdef AT_LEAST_ONCE
	assert(!(fenced_out > 0 && rec == COMPLETED && calls == 2));
#else
	assert(!(fenced_out > 0 && rec == ABANDONED));
#endif
#endif
#endif
}
