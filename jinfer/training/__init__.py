"""Training runs that produce jinfer's artifacts (a distilled draft model, Medusa heads), apart from
the serving path: they import the library downward and nothing imports them."""
