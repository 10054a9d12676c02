-- Reply: the budget's tallies (_budget.lua): e, b, m over the namespace, then of owner (0 when "").
return budget_tallies(owner)
