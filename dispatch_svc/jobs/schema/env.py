from accelmesh.runtime.database import run_migrations_online

run_migrations_online()
