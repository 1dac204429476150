//! The ledger on SQLite: the key row and the effect's rows commit together.

use super::Answer;
use rusqlite::{Connection, OptionalExtension, TransactionBehavior};

/// The table holding answers by idempotency key, in the tool's own database.
pub const TABLE: &str = "stepgate_ledger";

#[derive(Debug, thiserror::Error)]
pub enum LedgerError<E> {
    #[error("the tool's database")]
    Db(#[from] rusqlite::Error),
    /// The effect failed: its transaction was rolled back, nothing is stored,
    /// and a retry runs it again.
    #[error("the effect failed")]
    Effect(#[source] E),
}

/// Runs each key's effect at most once per database.
pub struct Ledger;

impl Ledger {
    /// Create the ledger table if it does not exist.
    pub fn install(conn: &Connection) -> rusqlite::Result<()> {
        conn.execute_batch(&format!(
            "CREATE TABLE IF NOT EXISTS {TABLE} (
                 key TEXT PRIMARY KEY,
                 status INTEGER NOT NULL,
                 body TEXT NOT NULL,
                 created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
             )"
        ))
    }

    /// The stored answer for `key`, or: run `effect` and store its answer, in
    /// one transaction. `effect` returns the HTTP status and JSON body to send;
    /// a refusal (4xx) may be stored too, so a retry gets the same refusal.
    /// When `effect` fails, everything it did is rolled back.
    ///
    /// The transaction is `IMMEDIATE`: two concurrent calls with one key are
    /// serialised, and the second gets the first one's answer.
    pub fn once<E>(
        conn: &mut Connection,
        key: &str,
        effect: impl FnOnce(&rusqlite::Transaction<'_>) -> Result<(u16, serde_json::Value), E>,
    ) -> Result<Answer, LedgerError<E>> {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let stored: Option<(u16, String)> = tx
            .query_row(
                &format!("SELECT status, body FROM {TABLE} WHERE key = ?1"),
                [key],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?;
        if let Some((status, body)) = stored {
            return Ok(Answer {
                status,
                body: serde_json::from_str(&body).unwrap_or(serde_json::Value::String(body)),
                replayed: true,
            });
        }
        let (status, body) = effect(&tx).map_err(LedgerError::Effect)?;
        tx.execute(
            &format!("INSERT INTO {TABLE} (key, status, body) VALUES (?1, ?2, ?3)"),
            rusqlite::params![key, status, body.to_string()],
        )?;
        tx.commit()?;
        Ok(Answer {
            status,
            body,
            replayed: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn db() -> Connection {
        let conn = Connection::open_in_memory().unwrap();
        Ledger::install(&conn).unwrap();
        conn.execute_batch("CREATE TABLE tickets (id INTEGER PRIMARY KEY, title TEXT)")
            .unwrap();
        conn
    }

    fn create(conn: &mut Connection, key: &str, title: &str) -> Answer {
        Ledger::once(conn, key, |tx| {
            tx.execute("INSERT INTO tickets (title) VALUES (?1)", [title])?;
            Ok::<_, rusqlite::Error>((201, serde_json::json!({"id": tx.last_insert_rowid()})))
        })
        .unwrap()
    }

    fn tickets(conn: &Connection) -> i64 {
        conn.query_row("SELECT count(*) FROM tickets", [], |r| r.get(0))
            .unwrap()
    }

    #[test]
    fn a_retry_gets_the_stored_answer_and_no_second_effect() {
        let mut conn = db();
        let first = create(&mut conn, "k1", "Printer on fire");
        assert!(!first.replayed);
        // The retry is rephrased: the key decides, not the arguments.
        let again = create(&mut conn, "k1", "The printer is on fire");
        assert!(again.replayed);
        assert_eq!((again.status, &again.body), (201, &first.body));
        assert_eq!(tickets(&conn), 1);
        // Same title, another step: a second ticket.
        let other = create(&mut conn, "k2", "Printer on fire");
        assert_ne!(other.body, first.body);
        assert_eq!(tickets(&conn), 2);
    }

    #[test]
    fn a_failed_effect_leaves_nothing_behind() {
        let mut conn = db();
        let r = Ledger::once(&mut conn, "k1", |tx| {
            tx.execute("INSERT INTO tickets (title) VALUES ('half done')", [])?;
            Err::<(u16, serde_json::Value), _>(rusqlite::Error::InvalidQuery)
        });
        assert!(matches!(r, Err(LedgerError::Effect(_))));
        assert_eq!(tickets(&conn), 0);
        // Nothing stored for the key: the retry runs.
        assert!(!create(&mut conn, "k1", "t").replayed);
        assert_eq!(tickets(&conn), 1);
    }
}
